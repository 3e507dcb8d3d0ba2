"""The GPU acceptance check's report: ``$OUT/summary.md``, ``results.md`` and ``results.json``.

    python bench/acceptance_report.py --work DIR --out OUT --mode gpu|smoke [--final]

bench/gpu_acceptance.sh calls it after every section, so the summary is current even if the
script is stopped. It reads ``DIR/<section>.json`` (bench/gpu_acceptance.py), ``DIR/<section>.rc``
(``"<exit status> <seconds>"``, written by the shell script) and ``OUT/pytest.xml`` (the
gpu-marked tests' JUnit report). A section's status is its JSON's (pass, fail, skip), or fail
when it exited non-zero or ran out of time (124, 137), or "not run". With ``--final`` the exit
status is 1 when any section failed or did not run. Imports no torch (it runs in a blink).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["SECTIONS", "collect", "main"]

SECTIONS = [("decisive", "1. LeNet-5 at b = 16 in every system"),
            ("bandwidth", "2. SMA kernel bandwidth, data out of L2"),
            ("throughput", "3. throughput against plain PyTorch"),
            ("w1", "4. W1 time to 99.0 % on real MNIST"),
            ("profile", "5. torch.profiler: kernels and host µs per round"),
            ("tests", "6. gpu-marked tests"),
            ("races", "7. race probes"),
            ("reference", "8. CUDA fits against the CPU reference"),
            ("nccl", "9. NCCL with one rank")]


def _rc(work: Path, name: str) -> tuple[int | None, float | None]:
    path = work / f"{name}.rc"
    if not path.exists():
        return None, None
    rc, seconds = path.read_text().split()[:2]
    return int(rc), float(seconds)


def _junit(path: Path, gpu: bool) -> dict:
    """The gpu-marked tests' counts and failures from pytest's JUnit XML."""
    if not path.exists():
        return {"status": "fail", "key": "no JUnit report", "notes": [], "tables": {}, "data": {}}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in suite.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            msg = (bad.get("message") or "").splitlines()[0][:200] if bad.get("message") else ""
            failed.append(f"{case.get('classname')}::{case.get('name')}: {msg}")
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    key = f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped"
    status = "fail" if failed or n["failures"] or n["errors"] else "pass"
    notes = [f"FAIL: {f}" for f in failed]
    if status == "pass" and passed == 0:
        status = "fail" if gpu else "skip"
        notes.append("every gpu-marked test was skipped: " +
                     ("pytest saw no CUDA GPU" if gpu else "no GPU here (collection checked)"))
    return {"status": status, "key": key, "notes": notes, "tables": {}, "data": n | {"failed": failed}}


def collect(work: Path, out: Path, gpu: bool) -> dict:
    """Every section's result, its exit status and seconds folded in."""
    sections = {}
    for name, _ in SECTIONS:
        rc, seconds = _rc(work, name)
        path = work / f"{name}.json"
        if name == "tests":
            doc = _junit(out / "pytest.xml", gpu) if rc is not None else None
        else:
            doc = json.loads(path.read_text()) if path.exists() else None
        if rc is None:
            doc = {"status": "not run", "key": "", "notes": [], "tables": {}, "data": {}}
        elif doc is None:
            doc = {"status": "fail", "key": "", "notes": [], "tables": {}, "data": {}}
        if rc in (124, 137):
            doc["status"] = "fail"
            doc["notes"] = [f"FAIL: stopped at its time limit after {seconds:.0f} s"] + doc["notes"]
        elif rc not in (None, 0) and doc["status"] != "fail":
            doc["status"] = "fail"
            doc["notes"] = [f"FAIL: exited {rc} (acceptance.log has its output)"] + doc["notes"]
        elif rc not in (None, 0) and not doc["notes"]:
            doc["notes"] = [f"FAIL: exited {rc} (acceptance.log has its output)"]
        sections[name] = doc | {"rc": rc, "seconds": seconds}
    env_path = work / "env.json"
    env = json.loads(env_path.read_text()) if env_path.exists() else {}
    return {"mode": "gpu" if gpu else "smoke", "env": env, "sections": sections}


def _summary(res: dict) -> str:
    gpu = res["mode"] == "gpu"
    lines = [f"# GPU acceptance ({'on a GPU' if gpu else 'smoke run on the CPU'})", ""]
    env = res["env"].get("data", {})
    for k in ("gpu", "nvidia-smi", "torch", "cuda", "cudnn", "triton", "python", "host"):
        if k in env:
            lines.append(f"- {k}: {env[k]}")
    for note in res["env"].get("notes", []):
        lines.append(f"- {note}")
    failed = [label for name, label in SECTIONS if res["sections"][name]["status"] in ("fail", "not run")]
    lines += ["", "| section | status | seconds | key numbers |", "|---|---|---|---|"]
    for name, label in SECTIONS:
        s = res["sections"][name]
        secs = f"{s['seconds']:.0f}" if s["seconds"] is not None else "—"
        lines.append(f"| {label} | {s['status']} | {secs} | {s['key'] or '—'} |")
    lines += ["", f"**Overall: {'FAIL — ' + ', '.join(failed) if failed else 'PASS'}**", ""]
    for name, label in SECTIONS:
        s = res["sections"][name]
        lines += [f"## {label}: {s['status']}", ""]
        lines += [f"- {n}" for n in s["notes"]]
        for title, table in s["tables"].items():
            lines += ["", f"{title}:", "", table]
        lines.append("")
    return "\n".join(lines)


def _results_md(res: dict) -> str:
    lines = [f"# GPU acceptance tables ({'GPU' if res['mode'] == 'gpu' else 'smoke run on the CPU'})",
             "", f"{res['env'].get('key', '')}", ""]
    for name, label in SECTIONS:
        for title, table in res["sections"][name]["tables"].items():
            lines += [f"## {label}", "", f"{title}:", "", table, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mode", choices=["gpu", "smoke"], required=True)
    ap.add_argument("--final", action="store_true", help="exit 1 if any section failed or did not run")
    args = ap.parse_args(argv)
    res = collect(args.work, args.out, args.mode == "gpu")
    (args.out / "summary.md").write_text(_summary(res))
    (args.out / "results.md").write_text(_results_md(res))
    (args.out / "results.json").write_text(json.dumps(res, indent=2, default=str))
    if not args.final:
        return 0
    bad = [name for name, _ in SECTIONS if res["sections"][name]["status"] in ("fail", "not run")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
