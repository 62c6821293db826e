"""Host (CPU) time of a training step at full size as rank 0 of W, against the predicted GPU time of that step: does
the GPU ever wait for Python? (issue 31 item 4; docs/host_overhead.md holds the table.)

    python -m benchmarks.host_overhead --preset dit_15b --world-size 32 --optimizers adamw muon periodic_rowwise \\
        [--blocks-per-unit 1 2 4] [--compiled] [--launch-us 8] [--view-us 2] [--launch-extra-us 3] \\
        [--json out.jsonl] [overrides]

How: the trainer's step (memory_estimate.fake_training: FSDP2 plan, sharded optimizer, EMA, on a fake process group,
the scaling study's config) runs in fresh processes per optimizer. Neither run can be timed as it stands: a fake
operator costs Python that a GPU run does not pay (a fake bmm ~ms, a launch ~5-10 us), and real tensors at full
size need the GPU. So the host time is rebuilt from measured parts:
  calls   the operators dispatched at full size on fake tensors (dispatch_counter: kernels, views/allocations,
          collectives), each costed at a stated host price: --launch-us per kernel or collective (eager dispatch
          + CUDA launch), --view-us per view or allocation (dispatch only);
  python  the same step on real tensors with the model shrunk to 4 channels per head and one image of 2 x 2
          patches (the same structure and calls, next to no compute; --top-ops prints both counts): its thread CPU
          time minus the time inside the dispatched operators and minus the counter's own per-call cost
          (dispatch_counter.per_call_overhead_s), i.e. the trainer's, FSDP2's, autograd's and the optimizer's Python
          and C++ around the operators; and the same step's whole thread time without the counter;
  compiled  (--compiled) the shrunk step with the blocks torch.compile'd (parallel.compile=true): its launches
          counted by the profiler (launch_profile.py) and its thread time.
  Python calls  the shrunk (or compiled) step's Python function calls per phase (count_python_calls): what the
          thread time mostly pays for, counted exactly where the load makes the time scatter.
eager host = python + kernels x launch + views x view; direct host (eager or compiled) = thread time + launches x
--launch-extra-us. Warm-up steps first (every direction once, DTensor's sharding propagation cached, compiled code
compiled), then one step of each kind (periodic_rowwise: between steps and the refresh).
--blocks-per-unit measures each optimizer once per FSDP2 unit size (parallel.blocks_per_fsdp_unit), one after the
other, so that the unit sizes are compared side by side under the same load.
Not in the fake step (they need real values): the trainer's loss/stop-vote all-reduce and its one host read
(~12 calls, Trainer.train_step), the data loader. The GPU time is benchmarks/cost_model's (predicted_gpu_step_s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the trainer's own phases (Trainer.train_step's timer marks); other: clipping, EMA, zero_grad, LR schedule, noise
PHASES = ("forward", "backward", "optimizer", "other")
KIND_OF_STEP = {None: "every", 1.0: "refresh", 0.0: "between"}  # opt/refresh of step_info


def predicted_gpu_step_s(model_cfg, optimizer_cfg, world_size: int, images_per_rank: int,
                         blocks_per_unit: int = 1) -> dict[str, float]:
    """GPU seconds of each step kind on an H100 by benchmarks/cost_model: forward + backward counted (its profile's
    `compute`, without activation checkpointing's recompute), FSDP2's exposed communication (units of
    `blocks_per_unit` blocks), and the optimizer step of that kind (on W > 1 counted on the sharded step: call
    before a process group is initialised)."""
    from benchmarks.cost_model.contender import Optim
    from benchmarks.cost_model.hardware import PROFILES
    from benchmarks.cost_model.predict import forward_backward, predict
    from benchmarks.cost_model.shapes import shapes_of

    hw, shapes = PROFILES["h100"], shapes_of(model_cfg)
    name = optimizer_cfg.get("name")
    opt = Optim(name, int(optimizer_cfg.get("K", 1) or 1), optimizer_cfg.get("rownorm_scale", "spectral"),
                optimizer_cfg.get("distributed_mode", "owner"))
    fb = forward_backward(shapes, hw, world_size, images_per_rank, blocks_per_unit=blocks_per_unit)
    steps = predict(shapes, opt, hw, world_size)["steps"]
    kinds = {"every": "adamw" if name == "adamw" else "refresh", "refresh": "refresh", "between": "rownorm"}
    return {kind: fb["compute"] + fb["fsdp_exposed"] + steps[step] for kind, step in kinds.items() if step in steps}


def host_ms(calls: dict, python_s: float, launch_us: float, view_us: float) -> float:
    launches = calls.get("kernel", 0) + calls.get("collective", 0)
    return python_s * 1e3 + (launches * launch_us + calls.get("no_kernel", 0) * view_us) / 1e3


def measure(cfg, world_size: int, micro_batch: int, mode: str = "fake") -> list[dict]:
    """One row per measured step: {"step", "refresh", phase: {"calls", "python_s", "top_ops", ...}} for the phases of
    Trainer.train_step (run as the trainer runs it): forward, backward, optimizer, and other (gradient clipping,
    EMA, zero_grad, LR schedule, the step's noise). mode: "fake" (full size, counted by a TorchDispatchMode),
    "shrunk" (real tiny tensors, counted the same way, then timed without the counter) or "compiled" (real tiny
    tensors, the blocks torch.compile'd: counted by the profiler, launch_profile.py, as a dispatch mode would make
    compiled code run eager; then timed without it)."""
    import torch

    from dit_train.parallel.memory_estimate import empty_all_to_all_inputs_allowed, fake_training, steps_for
    from benchmarks.dispatch_counter import DispatchCounter, FakeDispatchCounter, per_call_overhead_s
    from benchmarks.launch_profile import LaunchProfile, kernel_events

    torch.set_num_threads(1)  # fake tensors do no arithmetic; shrunk real ones next to none
    if mode == "compiled":
        kernel_events()  # before anything is compiled
    counter = {"fake": lambda: FakeDispatchCounter(allow_non_fake_inputs=True), "shrunk": DispatchCounter,
               "compiled": LaunchProfile}[mode]()
    run = fake_training(cfg, world_size, micro_batch, counter if mode == "fake" else contextlib.nullcontext())
    opt = run.optimizer
    K = cfg.optimizer.get("K") or 1
    rows = []
    timer = run.trainer.timer
    counting = counter.profiling if mode == "compiled" else contextlib.nullcontext
    with counter if mode != "compiled" else contextlib.nullcontext(), empty_all_to_all_inputs_allowed():
        # compiled: the first step compiles; K more steps in case a guard recompiles, keeping the measured steps
        # in the eager runs' order of step kinds (combined() pairs them by position)
        for _ in range(steps_for(cfg.optimizer) + (K if mode == "compiled" else 0)):
            run.trainer.train_step(run.x, {"y": run.y})
        for i in range(K):  # periodic: K - 1 between steps and a refresh; else one step
            counter.reset()
            timer.phase = outermost(counter.phase)  # the trainer's phase marks attribute the calls
            with counting():
                timed_step(run, counter.total_s)
            del timer.phase
            row = {"step": i, "refresh": opt.step_info().get("opt/refresh")}
            for name in PHASES:
                row[name] = {"calls": dict(counter.calls.get(name, {})), "inside_s": counter.inside_s[name],
                             "total_s": counter.total_s[name], "top_ops": counter.ops.get(name, {}).most_common(8)}
            rows.append(row)
    if mode != "fake":  # the same steps again without the counter: the thread's whole CPU time, nothing subtracted
        with empty_all_to_all_inputs_allowed():
            for row in rows:
                spent = Counter()

                @contextlib.contextmanager
                def phase(name):
                    start = time.thread_time()
                    yield
                    spent[name] += time.thread_time() - start

                timer.phase = outermost(phase)
                timed_step(run, spent)
                del timer.phase
                for name in PHASES:
                    row[name]["uncounted_s"] = spent[name]
            count_python_calls(run, rows)
    if mode == "compiled":  # no Python estimate by subtraction: the profiler's events do not time the launches
        return rows
    overhead = per_call_overhead_s(type(counter))
    for row in rows:
        for name in PHASES:
            ph = row[name]
            n = sum(ph["calls"].values())
            ph["python_s"] = max(0.0, ph["total_s"] - ph["inside_s"] - n * overhead)
        row["per_call_overhead_s"] = overhead
    return rows


def outermost(phase):
    """The timer's `phase` for the trainer's marks only: the phases opened inside one (the optimizer's momentum,
    direction, comm and update, on the same timer) count towards the enclosing one, as the trainer's phase does."""
    depth = 0

    @contextlib.contextmanager
    def mark(name):
        nonlocal depth
        depth += 1
        try:
            if depth > 1:
                yield
            else:
                with phase(name):
                    yield
        finally:
            depth -= 1

    return mark


def count_python_calls(run, rows: list[dict]) -> None:
    """The same steps once more under sys.setprofile: the Python function calls of each phase (FSDP2's hooks,
    autograd's Python functions, module calls, the trainer's and the optimizer's code) as row[phase]
    ["python_calls"]: a count that the machine's load cannot change, beside the thread time that it can. Run
    inside empty_all_to_all_inputs_allowed, as the other passes."""
    calls, current = Counter(), ["other"]

    @contextlib.contextmanager
    def phase(name):
        current[0] = name
        try:
            yield
        finally:
            current[0] = "other"

    def profile(frame, event, arg):
        if event == "call":
            calls[current[0]] += 1

    timer = run.trainer.timer
    timer.phase = outermost(phase)
    for row in rows:  # the step kinds in the order measured (one cycle)
        calls.clear()
        sys.setprofile(profile)
        try:
            run.trainer.train_step(run.x, {"y": run.y})
        finally:
            sys.setprofile(None)
        for name in PHASES:
            row[name]["python_calls"] = calls[name]
    del timer.phase


def timed_step(run, spent) -> None:
    """One Trainer.train_step; the thread time outside its phases (marked by the trainer's timer) goes to 'other'."""
    start, inside = time.thread_time(), sum(spent[name] for name in PHASES[:-1])
    run.trainer.train_step(run.x, {"y": run.y})
    spent["other"] += time.thread_time() - start - (sum(spent[name] for name in PHASES[:-1]) - inside)


def run_one(args) -> dict:
    """One optimizer in this process: the full-size step on fake tensors (--mode fake: the calls), or the same step
    on real tensors with the model's width shrunk to 4 per head, one image of 2 x 2 patches (the compute left is
    next to nothing) and the same structure: --mode shrunk (eager: the Python time) or --mode compiled (the blocks
    torch.compile'd as parallel.compile=true does: launches and thread time)."""
    from dit_train.parallel.memory_estimate_cli import compose

    cfg = compose(args.preset, args.optimizer, False, args.overrides)
    micro = args.micro_batch or cfg.train.batch_size // args.world_size
    per_unit = cfg.parallel.blocks_per_fsdp_unit
    # the prediction counts the sharded optimizer step (seconds of CPU at full size): once, in the fake run, whose
    # record the combined result keeps
    gpu_s = predicted_gpu_step_s(cfg.model, cfg.optimizer, args.world_size, micro, per_unit) \
        if args.mode == "fake" else None
    if args.mode != "fake":
        cfg.model.hidden_size, cfg.model.image_size, micro = 4 * cfg.model.num_heads, 2 * cfg.model.patch_size, 1
    cfg.parallel.compile = args.mode == "compiled"
    return {"preset": args.preset, "optimizer": args.optimizer, "world_size": args.world_size, "micro_batch": micro,
            "mode": args.mode, "overrides": list(args.overrides), "blocks_per_unit": per_unit, "gpu_step_s": gpu_s,
            "steps": measure(cfg, args.world_size, micro, args.mode)}


def combined(fake: dict, shrunk: dict, compiled: dict | None = None) -> dict:
    """The full-size calls with the shrunk run's Python time, step by step; with a compiled run, its launches and
    thread time of each phase beside them (compiled_calls, compiled_thread_s)."""
    out = dict(fake, steps=[])
    for i, (f, s) in enumerate(zip(fake["steps"], shrunk["steps"], strict=True)):
        step = {**f, **{name: {**f[name], "python_s": s[name]["python_s"], "shrunk_calls": s[name]["calls"],
                               "shrunk_thread_s": s[name]["uncounted_s"],
                               "shrunk_python_calls": s[name].get("python_calls")} for name in PHASES}}
        if compiled is not None:
            c = compiled["steps"][i]
            if c["refresh"] != f["refresh"]:
                raise RuntimeError(f"step {i}: the compiled run measured another kind of step than the eager one")
            for name in PHASES:
                step[name].update(compiled_calls=c[name]["calls"], compiled_thread_s=c[name]["uncounted_s"],
                                  compiled_python_calls=c[name].get("python_calls"),
                                  compiled_top_ops=c[name]["top_ops"])
        out["steps"].append(step)
    return out


def launches(calls: dict) -> int:
    return calls.get("kernel", 0) + calls.get("collective", 0)


def calls_of(step: dict, key: str) -> int | str:
    """Forward+backward's Python calls of a combined step; "-" for a result saved before they were counted."""
    counts = [step[n].get(key) for n in ("forward", "backward")]
    return "-" if None in counts else sum(counts)


def table(results: list[dict], launch_us: float, view_us: float, extra_us: float) -> str:
    """Lines per measured step kind: calls and host ms per phase, and host / predicted GPU step, by two methods:
      eager          python (shrunk run minus its counted calls) + full-size calls x price (--launch-us, --view-us)
      eager direct   the tiny step's whole thread CPU time (Python, dispatch and its near-empty CPU kernels) +
                     launches x --launch-extra-us (the CUDA launch a CPU kernel call does not pay): a cross-check
      compiled       the same direct method on the step with the blocks compiled (launches: the profiler's count)
    Optimizer and "other" (clipping, EMA, zero_grad, LR schedule) are compiled in none of them: every line takes
    the eager method's figures there. "fwd+bwd Python calls": the tiny step's forward+backward Python function
    calls (count_python_calls); "fwd+bwd thread ms": its thread CPU time."""
    lines = [f"eager: {launch_us:g} us per kernel or collective, {view_us:g} us per view or allocation; direct: "
             f"+{extra_us:g} us per launch on the tiny step's thread time; GPU step: benchmarks/cost_model on an "
             "H100 SXM (forward+backward counted, exposed FSDP2 communication, the optimizer step of that kind)", "",
             "| preset | W | blocks per unit | optimizer | step | method | fwd+bwd launches | fwd+bwd views "
             "| fwd+bwd Python calls | fwd+bwd thread ms | fwd+bwd host ms | optimizer calls | optimizer host ms "
             "| clip, EMA etc. host ms | step host ms | GPU step ms | host / GPU |",
             "| --- | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | ---: |"]
    fb = ("forward", "backward")
    for r in results:
        seen = set()
        for st in r["steps"]:
            kind = KIND_OF_STEP[st["refresh"]]
            if kind in seen:
                continue
            seen.add(kind)
            ms = {name: host_ms(st[name]["calls"], st[name]["python_s"], launch_us, view_us) for name in PHASES}
            gpu = r["gpu_step_s"][kind] * 1e3
            rest = ms["optimizer"] + ms["other"]
            thread = sum(st[n]["shrunk_thread_s"] for n in fb) * 1e3
            py = calls_of(st, "shrunk_python_calls")
            full = {k: sum(st[n]["calls"].get(k, 0) for n in fb) for k in ("kernel", "collective", "no_kernel")}
            methods = [("eager", full, py, thread, ms["forward"] + ms["backward"]),
                       ("eager direct", full, py, thread, thread + launches(full) * extra_us / 1e3)]
            if "compiled_calls" in st["forward"]:
                comp = {k: sum(st[n]["compiled_calls"].get(k, 0) for n in fb) for k in ("kernel", "collective",
                                                                                           "no_kernel")}
                cthread = sum(st[n]["compiled_thread_s"] for n in fb) * 1e3
                cpy = calls_of(st, "compiled_python_calls")
                methods.append(("compiled", comp, cpy, cthread, cthread + launches(comp) * extra_us / 1e3))
            for method, calls, py_calls, th, fb_ms in methods:
                total = fb_ms + rest
                lines.append(
                    f"| {r['preset']} | {r['world_size']} | {r['blocks_per_unit']} | {r['optimizer']} | {kind} "
                    f"| {method} "
                    f"| {launches(calls)} | {calls['no_kernel']} | {py_calls} | {th:.1f} | {fb_ms:.1f} "
                    f"| {sum(st['optimizer']['calls'].values())} | {ms['optimizer']:.1f} | {ms['other']:.1f} "
                    f"| {total:.1f} | {gpu:.0f} | {total / gpu:.1%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="dit_15b")
    p.add_argument("--world-size", type=int, default=32)
    p.add_argument("--optimizers", nargs="+", default=["adamw", "muon", "periodic_rowwise"])
    p.add_argument("--micro-batch", type=int, default=0, help="images per rank (default: train.batch_size / W)")
    p.add_argument("--launch-us", type=float, default=8.0, help="host us per kernel launch or collective")
    p.add_argument("--view-us", type=float, default=2.0, help="host us per view or allocation")
    p.add_argument("--launch-extra-us", type=float, default=3.0,
                   help="direct method: host us a CUDA launch adds to the tiny step's CPU kernel call")
    p.add_argument("--blocks-per-unit", type=int, nargs="+", default=[1],
                   help="parallel.blocks_per_fsdp_unit: each optimizer is measured once per value, in turn")
    p.add_argument("--compiled", action="store_true",
                   help="also measure the step with the blocks torch.compile'd (parallel.compile=true)")
    p.add_argument("--json", help="append each result to this JSONL file")
    p.add_argument("--top-ops", action="store_true", help="also print each phase's most frequent operators")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # one optimizer, JSON on stdout
    p.add_argument("--optimizer", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("fake", "shrunk", "compiled"), default="fake", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.depth=2")
    args = p.parse_args(argv)
    for name in args.optimizers:
        if name not in ("adamw", "muon", "periodic_rowwise", "rownorm", "mud"):
            p.error(f"--optimizers: {name!r} is not an optimizer (adamw, muon, periodic_rowwise, rownorm, mud)")
    if args.one:
        print(json.dumps(run_one(args)))
        return 0
    if any(o.startswith("parallel.blocks_per_fsdp_unit=") for o in args.overrides):
        p.error("give the unit sizes as --blocks-per-unit, not as an override")
    for per_unit in args.blocks_per_unit:
        if per_unit < 1:
            p.error(f"--blocks-per-unit: {per_unit} is not a number of blocks (an integer >= 1)")
    results = []
    for name, per_unit in [(n, u) for n in args.optimizers for u in args.blocks_per_unit]:
        runs = {}  # a fresh process each: the fake process group and compiled state are global
        for mode in ("fake", "shrunk") + (("compiled",) if args.compiled else ()):
            cmd = [sys.executable, "-m", "benchmarks.host_overhead", "--one", "--mode", mode, "--optimizer", name,
                   "--preset", args.preset, "--world-size", str(args.world_size), "--micro-batch",
                   str(args.micro_batch), *args.overrides, f"parallel.blocks_per_fsdp_unit={per_unit}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                sys.exit(f"error: {name} ({mode}) failed: {proc.stderr.strip()[-2000:]}")
            runs[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = combined(runs["fake"], runs["shrunk"], runs.get("compiled"))
        results.append(r)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")
        if args.top_ops:
            for st in r["steps"]:
                for name_ in PHASES:
                    print(f"{r['optimizer']} step {st['step']} {name_}: {st[name_]['calls']} (shrunk: "
                          f"{st[name_]['shrunk_calls']}) python {st[name_]['python_s'] * 1e3:.1f} ms, shrunk "
                          f"step uncounted {st[name_]['shrunk_thread_s'] * 1e3:.1f} ms; "
                          f"top {st[name_]['top_ops']}")
                    if "compiled_calls" in st[name_]:
                        print(f"  compiled: {st[name_]['compiled_calls']}, thread "
                              f"{st[name_]['compiled_thread_s'] * 1e3:.1f} ms; top {st[name_]['compiled_top_ops']}")
    print(table(results, args.launch_us, args.view_us, args.launch_extra_us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
