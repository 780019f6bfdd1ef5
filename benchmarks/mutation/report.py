"""Sample the mutants and write the score and survivors of a mutmut run (used by `run.sh`).

    python benchmarks/mutation/report.py sample --every K
    python benchmarks/mutation/report.py report --every K --runtime S --out DIR [--target plugin]

Run from the root of the snapshot that mutmut ran in (it reads `mutants/**/*.meta`
and calls `mutmut results` / `mutmut show`, which read `setup.cfg` there).

`sample` prints the names of every `K`-th mutant, in the order mutmut generated them
(files sorted by path, mutants in source order): a deterministic sample.

`report` writes `summary.json` (counts, score, command) and `survivors.md` (each
surviving mutant's diff and its verdict from `verdicts.txt` beside this script,
`unclassified` where there is none; both targets' verdicts are there, keyed by mutant name).
The score is killed / (killed + survived + timeout) over the mutants checked; mutants that no
selected test reaches ("no tests") and those not checked (a run stopped early) are counted apart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MUTMUT = Path(sys.executable).with_name("mutmut")


def all_mutants() -> list[str]:
    """Every mutant's name, files sorted by path, mutants in the order mutmut wrote them."""
    names: list[str] = []
    for meta in sorted(str(p) for p in Path("mutants").rglob("*.py.meta")):
        names += list(json.loads(Path(meta).read_text())["exit_code_by_key"])
    return names


def sample(every: int) -> list[str]:
    return [name for i, name in enumerate(all_mutants()) if i % every == 0]


def statuses() -> dict[str, str]:
    """`mutmut results --all true`: `name: status` for every mutant."""
    out = subprocess.run([str(MUTMUT), "results", "--all", "true"], capture_output=True, text=True, check=True)
    pairs = (line.strip().rsplit(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    return {name: status for name, status in pairs}


def verdicts() -> dict[str, str]:
    """`verdicts.txt`: one `mutant-name<TAB>verdict` per line (`#` starts a comment)."""
    path = HERE / "verdicts.txt"
    rows = (line.split("\t", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))
    return {name.strip(): verdict.strip() for name, verdict in rows}


def command(target: str, every: int) -> str:
    """The run.sh command line that makes this target's results."""
    prefix = "" if target == "core" else f"TARGET={target} "
    return f"{prefix}bash benchmarks/mutation/run.sh {every}"


def summarize(every: int, runtime_s: float, tested: dict[str, str], total: int, target: str = "core") -> dict:
    counts: dict[str, int] = {}
    for status in tested.values():
        counts[status] = counts.get(status, 0) + 1
    killed, survived, timeout = (counts.get(s, 0) for s in ("killed", "survived", "timeout"))
    version = subprocess.run([str(MUTMUT), "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "tool": version,
        "command": command(target, every),
        "date": datetime.date.today().isoformat(),
        "mutants_total": total,
        "sample_every": every,
        "mutants_sampled": len(tested),
        "counts": dict(sorted(counts.items())),
        "score": round(killed / max(killed + survived + timeout, 1), 3),
        "runtime_s": round(runtime_s),
    }


def survivors_md(summary: dict, not_killed: dict[str, str]) -> str:
    known = verdicts()
    lines = [
        "# Mutants not killed",
        "",
        f"`{summary['command']}` ({summary['tool']}): {summary['mutants_sampled']} of {summary['mutants_total']} "
        f"mutants tested (every {summary['sample_every']}th), score {summary['score']}, counts {summary['counts']}.",
        "",
    ]
    for name, status in not_killed.items():
        diff = subprocess.run([str(MUTMUT), "show", name], capture_output=True, text=True).stdout.strip()
        verdict = known.get(name, "unclassified")
        lines += [f"## `{name}` ({status})", "", f"Verdict: {verdict}", "", "```diff", diff, "```", ""]
    return "\n".join(lines)


def report(every: int, runtime_s: float, out: Path, target: str = "core") -> None:
    chosen = set(sample(every))
    tested = {name: status for name, status in statuses().items() if name in chosen}
    summary = summarize(every, runtime_s, tested, len(all_mutants()), target)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    not_killed = {n: s for n, s in sorted(tested.items()) if s not in ("killed", "not checked")}
    (out / "survivors.md").write_text(survivors_md(summary, not_killed))
    print(json.dumps(summary, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("sample", "report"))
    parser.add_argument("--every", type=int, default=20, help="test every K-th mutant")
    parser.add_argument("--runtime", type=float, default=0.0, help="seconds the mutant run took")
    parser.add_argument("--out", type=Path, help="where `report` writes summary.json and survivors.md")
    parser.add_argument("--target", choices=("core", "plugin"), default="core", help="run.sh's TARGET")
    args = parser.parse_args()
    if args.every < 1:
        parser.error("--every must be >= 1")
    if args.action == "sample":
        print("\n".join(sample(args.every)))
    else:
        if args.out is None:
            parser.error("report needs --out")
        report(args.every, args.runtime, args.out, args.target)


if __name__ == "__main__":
    main()
