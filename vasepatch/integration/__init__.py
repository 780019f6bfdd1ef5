"""The transformers integration: `patch` a model (`patching`), the callables it installs (`wrappers`), the
handle it returns (`handle`), the attention implementation that runs each layer's step (`attention`), the
model families it recognises (`families`), tensor parallelism (`distributed`), `torch.compile` support
(`compile_support`) and the transformers versions it accepts (`compat`)."""
