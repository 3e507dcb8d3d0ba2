"""The GPU acceptance check's report: ``$OUT/summary.md``, ``results.md`` and ``results.json``.

    python bench/acceptance_report.py --work DIR --out OUT --mode gpu|smoke [--sections "A B"] [--final]

bench/gpu_acceptance.sh calls it after every section, so the summary is current even if the
script is stopped. It reads ``DIR/<section>.json`` (bench/gpu_acceptance.py), ``DIR/<section>.rc``
(``"<exit status> <seconds>"``, written by the shell script) and ``OUT/pytest-<section>.xml``
(the test sections' JUnit reports). A section's status is its JSON's (pass, fail, skip), or fail
when it exited non-zero or ran out of time (124, 137), "not run", or "not selected" (``SECTIONS``
named others). The summary's table of targets gives each decisive target met or missed on the
card named, a miss with the profile of its system; a smoke run's summary lists the checks only a
GPU can make. With ``--final`` the exit status is 1 when a selected section failed or did not
run. Imports no torch (it runs in a blink).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["SECTIONS", "collect", "main"]

SECTIONS = [("env", "1. environment, card, Triton kernels precompiled"),
            ("tests-early", "2. gpu-marked tests: graph rounds, device data"),
            ("decisive", "3. LeNet-5 at b = 16 in every system"),
            ("w1", "4. W1 time to 99.0 % on real MNIST"),
            ("memory", "5. memory: peak against the estimate, reserved over many rounds"),
            ("bandwidth", "6. SMA kernel bandwidth, data out of L2"),
            ("throughput", "7. throughput against plain PyTorch"),
            ("profile", "8. torch.profiler: kernels and host µs per round"),
            ("tests-late", "9. the other gpu-marked tests"),
            ("races", "10. race probes"),
            ("reference", "11. CUDA fits against the CPU reference"),
            ("nccl", "12. NCCL with one rank")]
TEST_SECTIONS = ("tests-early", "tests-late")
# what a smoke run cannot check (docs/benchmarking.md, "What only a GPU can confirm")
GPU_ONLY = [
    "every target: graph rounds ≥ 200 k samples/s at m = 4 (scaled to the card's launch µs), "
    "fused graph rounds at m = 16 ≥ 10× plain eager, the SMA kernel ≥ 80 % of the copy "
    "bandwidth, W1's time to 99.0 % ≤ 0.5× tuned plain PyTorch",
    "that real CUDA graphs capture and replay every round shape (a DataLoader's batches copied "
    "ahead, host data through pinned staging, resident data gathered in the graph) and equal "
    "eager rounds bit for bit; plain PyTorch's step in one CUDA graph",
    "that a capture failing after a clean warm-up leaves torch's allocator out of capture mode "
    "(memory_reserved() flat over 200 rounds) and the default stream current",
    "memory_reserved() flat over 500 graph rounds; the plan's peak against its estimate at "
    "m = 1, 8, 32 (the graph pool, per-stream workspaces, pinned staging)",
    "the gpu-marked tests (skipped here), the CUDA sanitizer, delayed streams on a GPU, NCCL",
    "the Triton kernels compiled and launched from the precompiled cache (here interpreted), "
    "their bandwidth with the data out of L2",
    "W1 on the GPU with the GPU defaults (SMA, 4 replicas per GPU, graph rounds) and the "
    "epochs and seconds per epoch at m = 1, 4, 16",
]


def _rc(work: Path, name: str) -> tuple[int | None, float | None]:
    path = work / f"{name}.rc"
    if not path.exists():
        return None, None
    rc, seconds = path.read_text().split()[:2]
    return int(rc), float(seconds)


def _junit(path: Path, gpu: bool) -> dict:
    """The gpu-marked tests' counts, failures and slowest tests from pytest's JUnit XML."""
    if not path.exists():
        return {"status": "fail", "key": "no JUnit report", "notes": [], "tables": {}, "data": {}}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed, times = [], []
    for case in suite.iter("testcase"):
        times.append((float(case.get("time") or 0), case.get("name")))
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            msg = (bad.get("message") or "").splitlines()[0][:200] if bad.get("message") else ""
            failed.append(f"{case.get('classname')}::{case.get('name')}: {msg}")
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    key = f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped"
    status = "fail" if failed or n["failures"] or n["errors"] else "pass"
    notes = [f"FAIL: {f}" for f in failed]
    slow = sorted(times, reverse=True)[:5]
    if gpu and slow:
        notes.append("slowest: " + ", ".join(f"{name} {t:.1f} s" for t, name in slow))
    if status == "pass" and passed == 0:
        status = "fail" if gpu else "skip"
        notes.append("every gpu-marked test was skipped: " +
                     ("pytest saw no CUDA GPU" if gpu else "no GPU here (collection checked)"))
    return {"status": status, "key": key, "notes": notes, "tables": {}, "data": n | {"failed": failed}}


def collect(work: Path, out: Path, gpu: bool, selected: list[str] | None = None) -> dict:
    """Every section's result, its exit status and seconds folded in; sections left out of
    ``selected`` (when given) are "not selected"."""
    sections = {}
    for name, _ in SECTIONS:
        rc, seconds = _rc(work, name)
        path = work / f"{name}.json"
        if name in TEST_SECTIONS:
            doc = _junit(out / f"pytest-{name}.xml", gpu) if rc is not None else None
        else:
            doc = json.loads(path.read_text()) if path.exists() else None
        if rc is None and selected and name != "env" and name not in selected:
            doc = {"status": "not selected", "key": "", "notes": [], "tables": {}, "data": {}}
        elif rc is None:
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
    return {"mode": "gpu" if gpu else "smoke", "env": env, "sections": sections,
            "targets": _targets(sections)}


def _targets(sections: dict) -> list[dict]:
    """Every section's checked targets, a miss with the profile of the system that explains it."""
    profile = sections.get("profile", {}).get("data", {})
    out = []
    for name, _ in SECTIONS:
        for t in sections[name].get("data", {}).get("targets", []):
            row = dict(t, section=name)
            if t["met"] is False:
                row["why"] = _explain(profile.get(t.get("explain") or "", None), t.get("explain"))
            out.append(row)
    return out


def _explain(prof: dict | None, system: str | None) -> str:
    """A missed target's profile line: kernels and host µs per round, the GPU's busy share."""
    if not system:
        return "no profiled system for this target (its section's table has the numbers)"
    if not prof:
        return f"{system}: not profiled (the profile section did not run it)"
    busy = prof.get("gpu_busy_share")
    bound = ("" if busy is None else "; host-bound: the GPU idles between rounds' kernels"
             if busy < 0.6 else "; GPU-bound: the kernels fill the round")
    share = f", GPU busy {busy:.0%}" if busy is not None else ""
    return (f"{system}: {prof['kernels_per_round']:.0f} kernels and {prof['host_us_per_round']:.0f} "
            f"host µs per round{share}{bound}")


def _value(v, unit: str) -> str:
    if v is None or v != v:
        return "—"
    return {"samples/s": f"{v:,.0f}", "×": f"{v:.2f}×", "%": f"{v:.0%}"}.get(unit, f"{v:.3g}")


def _targets_table(res: dict) -> list[str]:
    card = res["env"].get("data", {}).get("card", {}).get("name")
    lines = [f"## Targets{' on ' + card if card else ''}", "",
             "| target | measured | target on this card | how it scales | met |", "|---|---|---|---|---|"]
    for t in res["targets"]:
        met = {True: "yes", False: "MISS", None: "GPU only"}[t["met"]]
        sign = "≤" if t.get("at_most") else "≥"
        lines.append(f"| {t['name']} | {_value(t['value'], t['unit'])} | {sign} "
                     f"{_value(t['target'], t['unit'])} | {t['scale']} | {met} |")
    misses = [t for t in res["targets"] if t["met"] is False]
    lines += [""] + [f"- MISS: {t['name']}: {t['why']}" for t in misses]
    if res["mode"] != "gpu":
        lines += ["", "Checks only a GPU can make (not made by this smoke run):", ""]
        lines += [f"- {c}" for c in GPU_ONLY]
    return lines + [""]


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
    missed = sum(1 for t in res["targets"] if t["met"] is False)
    lines += ["", "| section | status | seconds | key numbers |", "|---|---|---|---|"]
    for name, label in SECTIONS:
        s = res["sections"][name]
        secs = f"{s['seconds']:.0f}" if s["seconds"] is not None else "—"
        lines.append(f"| {label} | {s['status']} | {secs} | {s['key'] or '—'} |")
    lines += ["", f"**Overall: {'FAIL — ' + ', '.join(failed) if failed else 'PASS'}**"
              + (f" ({missed} target(s) missed)" if missed else ""), ""]
    lines += _targets_table(res)
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
    ap.add_argument("--sections", default="", help="the sections SECTIONS selected (empty: all)")
    ap.add_argument("--final", action="store_true", help="exit 1 if any section failed or did not run")
    args = ap.parse_args(argv)
    res = collect(args.work, args.out, args.mode == "gpu", args.sections.split())
    (args.out / "summary.md").write_text(_summary(res))
    (args.out / "results.md").write_text(_results_md(res))
    (args.out / "results.json").write_text(json.dumps(res, indent=2, default=str))
    if not args.final:
        return 0
    bad = [name for name, _ in SECTIONS if res["sections"][name]["status"] in ("fail", "not run")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
