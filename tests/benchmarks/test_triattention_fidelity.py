"""`benchmarks/triattention/fidelity.py`: its conversion of our statistics to the authors' format, of a
transformers-5 config to one transformers 4.x reads, and its comparison of scores and kept sets (no model, no
authors' code)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ta_fidelity", ROOT / "benchmarks" / "triattention" / "fidelity.py")
fidelity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fidelity)


def test_authors_stats_names_every_layer_and_query_head_with_its_own_rows():
    q_mean = torch.randn(3, 4, 5, 2)
    q_abs = torch.rand(3, 4, 5)
    payload = fidelity.authors_stats(q_mean, q_abs, head_dim=10, model_name="m")
    assert payload["metadata"]["sampled_heads"] == [[layer, h] for layer in range(3) for h in range(4)]
    assert payload["metadata"]["head_dim"] == 10 and payload["metadata"]["rope_style"] == "half"
    assert len(payload["stats"]) == 12
    entry = payload["stats"]["layer02_head01"]
    assert torch.equal(entry["q_mean_real"], q_mean[2, 1, :, 0])
    assert torch.equal(entry["q_mean_imag"], q_mean[2, 1, :, 1])
    assert torch.equal(entry["q_abs_mean"], q_abs[2, 1])
    assert entry["q_mean_real"].dtype == torch.float32 and entry["q_mean_real"].shape == (5,)


def test_legacy_config_lifts_rope_theta_and_a_scaled_rope_type_to_the_top_level():
    config, changed = fidelity.legacy_config({"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}})
    assert config["rope_theta"] == 1e5 and "rope_scaling" not in config and changed == ["rope_theta=100000.0"]
    config, _ = fidelity.legacy_config({"rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}})
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    config, changed = fidelity.legacy_config({"rope_theta": 1e4})
    assert config == {"rope_theta": 1e4} and changed == []


def test_gapped_positions_are_ascending_distinct_subsets_per_layer_and_head():
    pos = fidelity.gapped_positions(2, 3, 50, 20, seed=0)
    assert pos.shape == (2, 3, 20)
    for row in pos.reshape(6, 20):
        assert torch.all(row[1:] > row[:-1]) and int(row.min()) >= 0 and int(row.max()) < 50
    assert not torch.equal(pos[0, 0], pos[0, 1])
    assert torch.equal(pos, fidelity.gapped_positions(2, 3, 50, 20, seed=0))


def test_compare_raw_reports_the_largest_difference_absolute_and_relative_to_the_scale():
    theirs = torch.tensor([[10.0, -20.0, 0.001]])
    ours = theirs + torch.tensor([[0.01, -0.02, 0.0005]])
    got = fidelity.compare_raw(ours, theirs)
    assert abs(got["max_abs"] - 0.02) < 1e-6 and got["scale"] == 20.0
    assert abs(got["max_rel"] - 0.001) < 1e-7
    assert abs(got["max_rel_elementwise"] - 0.001) < 1e-6  # 0.001 is under 1% of the scale: left out


def test_compare_kept_counts_identical_heads_differing_slots_and_the_margin_at_the_cut():
    aggregated = torch.tensor([[5.0, 4.0, 3.0, 2.9, 1.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    theirs = torch.tensor([[0, 1, 2], [4, 3, 2]])
    ours = torch.tensor([[2, 1, 0], [4, 3, 1]])
    got = fidelity.compare_kept(ours, theirs, aggregated, budget=3)
    assert got["heads_identical"] == 1 and got["heads"] == 2 and got["slots_differing"] == 1
    assert abs(got["min_cut_margin"] - 0.1) < 1e-6
