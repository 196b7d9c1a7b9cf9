#!/usr/bin/env python3
"""PyTorch's torch.distributed.pipelining with baton's synthetic cost model.

Runs one pipeline schedule of PyTorch (Gloo on loopback, one CPU process per
pipeline rank, one thread each) whose stage modules cost what baton's
synthetic ops cost (worker/synthetic_stage.cc):

  forward         F ms   (the op's output: activation_bytes of float32)
  input gradient  I ms   (only when autograd asks for the stage input's grad)
  weight gradient W ms   (only when autograd asks for the weight's grad)

Every op waits on a monotonic clock until F/I/W has passed since it started:
it sleeps until 300 us before the deadline, then spins, as baton's WaitUntil.

The stage module is  out = Fwd(x) + WGrad(w):  Fwd's forward costs F and its
backward (the input gradient) I; WGrad (the weight, 1024 floats) costs nothing
forward and W backward; the add joins them. Schedules that ask for a full
backward (GPipe, 1F1B, interleaved 1F1B) run both nodes (I + W); the
zero-bubble schedule asks for the input gradient first (autograd.grad with
inputs = the stage input: only Fwd's backward runs) and for the weight later
(only WGrad's backward runs). On the first stage PyTorch skips the input-only
backward (nothing upstream needs it) and runs the whole backward at W time;
the stage input is made a leaf that requires grad so that backward still costs
I + W there, as baton's first chunk does.

Per step: schedule.step() (all forwards, backwards and P2P messages of the
schedule; return_outputs=False), then w -= 0.01 * w.grad on the 1024 floats
and w.grad = None. The loss of the last stage is out.sum() (no target).
Step time = (latest rank's end) - (earliest rank's start) on the shared
monotonic clock, after a barrier. Bubble per rank = 1 - (time inside the op
functions) / (that rank's own step time), averaged over ranks.

Prints one JSON object. Usage (inside a venv with torch >= 2.6):
  python3 bench/pipeline_torch_bench.py --schedule=1f1b --pp=4 --microbatches=16 \
      --forward_ms=10 --backward_input_ms=10 --backward_weight_ms=10
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

SCHEDULES = {  # our name -> (PyTorch class, chunks per rank it needs)
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    # ZB1P of the Zero Bubble paper (= ZB-H1) when every rank holds one stage.
    "zb-h1": "ScheduleInterleavedZeroBubble",
}
GRAD_ELEMENTS = 1024  # baton's synthetic weight: 1024 floats
SPIN_S = 300e-6


def wait_until(start, seconds):
    deadline = start + seconds
    spin_from = deadline - SPIN_S
    now = time.monotonic()
    if now < spin_from:
        time.sleep(spin_from - now)
    while time.monotonic() < deadline:
        pass


def run_rank(rank, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="",
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    torch.set_num_threads(1)
    F, I, W = args.forward_ms / 1e3, args.backward_input_ms / 1e3, args.backward_weight_ms / 1e3
    busy = [0.0]  # seconds spent inside the op functions this step

    class Fwd(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            start = time.monotonic()
            y = x + 1.0
            wait_until(start, F)
            busy[0] += time.monotonic() - start
            return y

        @staticmethod
        def backward(ctx, grad):
            start = time.monotonic()
            g = grad + 1.0
            wait_until(start, I)
            busy[0] += time.monotonic() - start
            return g

    weight_grad = (torch.arange(GRAD_ELEMENTS) % 7 + 1).float() * 1e-3

    class WGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            return w.new_zeros(())

        @staticmethod
        def backward(ctx, grad):
            start = time.monotonic()
            g = weight_grad.clone()
            wait_until(start, W)
            busy[0] += time.monotonic() - start
            return g

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(GRAD_ELEMENTS))

        def forward(self, x):
            if not x.requires_grad:  # first stage: keep the input-gradient node in the graph
                x = x.detach().requires_grad_()
            return Fwd.apply(x) + WGrad.apply(self.weight)

    p, v, m = args.pp, args.virtual, args.microbatches
    elements = args.activation_bytes // 4
    dist.init_process_group("gloo", rank=rank, world_size=p)
    num_stages = p * v
    stage_ids = [rank + k * p for k in range(v)]  # Megatron placement, as baton
    modules = [Stage() for _ in stage_ids]
    stages = [pipelining.PipelineStage(mod, s, num_stages, torch.device("cpu")) for mod, s in zip(modules, stage_ids)]
    cls = getattr(pipelining, SCHEDULES[args.schedule])

    def loss_fn(out, target):
        return out.sum()

    if v == 1 and args.schedule in ("gpipe", "1f1b"):
        sched = cls(stages[0], n_microbatches=m, loss_fn=loss_fn)
    else:
        sched = cls(stages, n_microbatches=m, loss_fn=loss_fn)
    first, last = 0 in stage_ids, num_stages - 1 in stage_ids
    x = torch.zeros(m, elements)
    target = torch.zeros(m, 1)
    params = [mod.weight for mod in modules]

    steps = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        busy[0] = 0.0
        t0 = time.monotonic()
        kwargs = {"return_outputs": False}
        if last:
            kwargs["target"] = target
        if first:
            sched.step(x, **kwargs)
        else:
            sched.step(**kwargs)
        with torch.no_grad():
            for w in params:
                w -= 0.01 * w.grad
                w.grad = None
        t1 = time.monotonic()
        steps.append((t0, t1, busy[0]))
    all_steps = [None] * p
    dist.all_gather_object(all_steps, steps)
    if rank == 0:
        # The compute order PyTorch ran, as its own CSV (one row per rank). Only
        # the runtime schedules (interleaved, zero bubble) execute
        # pipeline_order; ScheduleGPipe/Schedule1F1B run their own loops (their
        # pipeline_order is a picture, and 2.15's 1F1B one is off by one on the
        # last rank), so nothing is written for them.
        if args.dump_order and args.schedule in ("interleaved", "zb-h1"):
            order = sched.pipeline_order
            with open(args.dump_order, "w") as f:
                for r in range(p):
                    cells = [a for a in order[r] if a is None or a.is_compute_op]
                    f.write(",".join("" if a is None else str(a) for a in cells) + "\n")
        queue.put({"steps": all_steps, "torch": torch.__version__})
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), required=True)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--virtual", type=int, default=1, help="chunks per rank (interleaved: 2)")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--forward_ms", type=float, default=10)
    ap.add_argument("--backward_input_ms", type=float, default=10)
    ap.add_argument("--backward_weight_ms", type=float, default=10)
    ap.add_argument("--activation_bytes", type=int, default=65536)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7, help="timed steps after the warm-up")
    ap.add_argument("--dump_order", default="",
                    help="interleaved, zb-h1: write the compute order PyTorch runs as its CSV (cells 0F0, 1I3, 2W3, 0B1)")
    args = ap.parse_args()
    if args.pp < 1 or args.virtual < 1 or args.microbatches < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--pp, --virtual, --microbatches and --steps must be >= 1, --warmup >= 0")
    if args.activation_bytes < 4 or args.activation_bytes > (1 << 30):
        ap.error("--activation_bytes must be in [4, 2^30]")
    if min(args.forward_ms, args.backward_input_ms, args.backward_weight_ms) < 0:
        ap.error("op times must be >= 0")
    if (args.schedule == "interleaved") != (args.virtual > 1):
        ap.error("--virtual > 1 goes with --schedule=interleaved and only with it")

    import torch.multiprocessing as mp
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, args, port, queue)) for r in range(args.pp)]
    for proc in procs:
        proc.start()
    result = None
    try:
        result = queue.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    if result is None or any(proc.exitcode for proc in procs):
        sys.exit("pipeline_torch_bench: a rank failed (exit codes %s)" % [proc.exitcode for proc in procs])

    per_rank = result["steps"]
    timed = range(args.warmup, args.warmup + args.steps)
    walls = [max(per_rank[r][i][1] for r in range(args.pp)) - min(per_rank[r][i][0] for r in range(args.pp))
             for i in timed]
    bubbles = []
    for i in timed:
        b = [1 - per_rank[r][i][2] / (per_rank[r][i][1] - per_rank[r][i][0]) for r in range(args.pp)]
        bubbles.append(sum(b) / len(b))
    print(json.dumps({
        "schedule": args.schedule, "torch_class": SCHEDULES[args.schedule], "torch": result["torch"],
        "pp": args.pp, "virtual": args.virtual, "microbatches": args.microbatches,
        "median_step_s": statistics.median(walls), "steps_s": walls,
        "bubble_ratio": statistics.median(bubbles),
        # time inside the op functions per rank and step (median over the timed
        # steps, then over ranks): m * (F + I + W) when the ops cost what they should
        "op_seconds_per_rank": statistics.median(
            statistics.median(per_rank[r][i][2] for i in timed) for r in range(args.pp)),
    }))


if __name__ == "__main__":
    main()
