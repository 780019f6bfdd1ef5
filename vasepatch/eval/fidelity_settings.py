"""`FidelitySettings`: what `vasepatch eval fidelity` runs (its flags, validated), used by both of its
modes: prompts (`vasepatch.eval.fidelity`) and a fixed probe (`vasepatch.eval.probe`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vasepatch.config import FULL, VaSEConfig
from vasepatch.eval import cli_options


@dataclass
class FidelitySettings:
    """What `vasepatch eval fidelity` runs (the CLI flags, validated): the cache settings
    `config` (one per policy: `config.replace(policy=name)`) and the eval's own."""

    model: str = "smollm2-135m"
    config: VaSEConfig = field(default_factory=cli_options.default_config)
    policies: list[str] = field(default_factory=lambda: [FULL, "vase", "snapkv"])
    prompts: str = "gsm8k:16"
    tokens: int = 768
    sample_temperature: float = 0.8
    seeds: int = 3
    batch_size: int = 4
    data_dir: str | None = None
    probe: str | None = None
    out: str = "fidelity-results"
    shared_heads: str = "off"  # "both": every evicting policy also as "<policy>+shared"

    def __post_init__(self) -> None:
        self.policies = cli_options.with_shared(self.policies, self.shared_heads)
        if self.shared_heads == "on":
            self.config = self.config.replace(shared_heads=True)
        cli_options.check_run(self.config, self.policies)
        if self.tokens < 2:
            raise ValueError(f"tokens must be >= 2, got {self.tokens}")
        if self.batch_size < 1 or self.seeds < 1:
            raise ValueError(f"batch_size and seeds must be >= 1, got {self.batch_size}, {self.seeds}")
        if not 0 < self.sample_temperature < float("inf"):
            raise ValueError(
                f"sample_temperature must be > 0 (the reference is sampled), got {self.sample_temperature}"
            )
        self.policies = [FULL, *[p for p in self.policies if p != FULL]]  # the reference comes first

    @property
    def seed(self) -> int:
        return self.config.seed

    def configs(self) -> dict[str, VaSEConfig]:
        """The cache config of each policy, `full` first."""
        return {name: cli_options.run_config(self.config, name) for name in self.policies}

    def header(self, model) -> dict[str, Any]:
        """The settings actually used, as written beside the results."""
        head: dict[str, Any] = {"model": self.model, "policies": self.policies}
        if self.probe:
            head.update(probe=Path(self.probe).name, seeds=self.seeds)
        else:
            head.update(
                prompts=self.prompts,
                tokens=self.tokens,
                sample_temperature=self.sample_temperature,
                batch_size=self.batch_size,
            )
        head.update(cli_options.cache_header(self.config))
        if self.shared_heads == "both":
            head["shared_heads"] = "both"
        return {**head, **cli_options.environment(model)}
