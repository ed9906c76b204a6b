"""Checks that need a GPU, each printed as it ends: what issue 58 asks of a lent GPU beside the timings.

1. The model FLOPs of the LM example's step are the same with cuDNN's fused
   attention as with XLA's (`throughput.model_flops` counts the fused kernel's
   products as the unfused attention's).
2. Device-to-host transfers between records: the loop runs K=1 and K=10 under
   JAX's transfer guard at "log" in a child process (the guard's lines go to
   stderr from C++), with a marker printed at each record; the lines between
   two markers are the transfers that a segment made (the record's own copy
   is made after the marker of the segment's end... so: segment, marker,
   record, marker).
3. Where the host's time goes at K=1 and K=10 (cProfile, the top functions by
   their own time), on the small MLP of `loop_overhead.py`.

    python benchmarks/gpu_checks.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def fused_attention_count() -> None:
    from sharded import lm

    from flaxstate.training import throughput

    counts = {}
    for attention in ("xla", "cudnn"):
        config = lm.Config(
            batch_size=4, seq_len=256, embed=256, heads=4, head_dim=64, mlp=1024, layers=2, dtype="bfloat16",
            attention=attention,
        )  # fmt: skip
        model = lm.Transformer(config)
        tokens = jnp.zeros((4, 256), jnp.int32)
        variables = model.init(jax.random.key(0), tokens)

        def loss(params, model=model, variables=variables, tokens=tokens):
            return lm.loss(model.apply({**variables, "params": params}, tokens), tokens)

        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(variables["params"])
        fused = sorted({e.primitive.name for e in jaxpr.jaxpr.eqns if "attention" in e.primitive.name})
        counts[attention] = throughput.model_flops(jaxpr)
        print(f"model FLOPs, attention={attention}: {counts[attention]:.6g} (fused primitives seen: {fused})")
    print(f"cudnn / xla: {counts['cudnn'] / counts['xla']:.6f}")


GUARDED = textwrap.dedent(
    """
    import itertools, sys, jax, optax
    sys.path.insert(0, {here!r})
    from loop_overhead import MLP, loss_fn, make_data
    import flaxstate as fs
    data = make_data(64, 64)
    for k in (1, 10):
        task = fs.TrainTask(apply=MLP(64).apply, optimizer=optax.adam(1e-3), loss=loss_fn, data=itertools.cycle(data))
        loop = fs.TrainLoop(MLP(64).init, task, 0, n_steps=10**9, n_steps_per_checkpoint=200,
                            n_steps_per_dispatch=k, stdout=False)
        loop.next_checkpoint()  # compiled
        with jax.transfer_guard_device_to_host("log"):
            for index in range(3):
                print(f"MARK K={{k}} before segment {{index}}", file=sys.stderr, flush=True)
                loop.next_checkpoint()
                print(f"MARK K={{k}} after record {{index}}", file=sys.stderr, flush=True)
    """
)


def guarded_transfers() -> None:
    result = subprocess.run(
        [sys.executable, "-c", GUARDED.format(here=str(HERE))], capture_output=True, text=True, timeout=120
    )
    counts: dict[str, int] = {}
    mark = None
    examples: dict[str, str] = {}
    for line in result.stderr.splitlines():
        if line.startswith("MARK "):
            mark = line[5:]
            counts.setdefault(mark, 0)
        elif mark is not None and "transfer" in line.lower():
            counts[mark] += 1
            examples.setdefault(mark, line[:300])
    print(f"exit {result.returncode}; device-to-host transfers logged by the guard, by stretch:")
    for mark, count in counts.items():
        print(f"  after '{mark}': {count}" + (f"   e.g. {examples[mark]}" if mark in examples else ""))
    if result.returncode:
        print(result.stderr[-3000:])


def host_profile() -> None:
    from loop_overhead import MLP, flaxstate_runner, make_data

    data = make_data(64, 64)
    for k in (1, 10):
        run = flaxstate_runner(MLP(64), data, k, 400)
        run(400)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(5):
            run(400)
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(22)
        print(f"--- K={k}: 2000 steps, the top functions by their own time")
        print("\n".join(out.getvalue().splitlines()[:40]))


if __name__ == "__main__":
    print(f"jax {jax.__version__}, {jax.devices()}")
    for check in (fused_attention_count, guarded_transfers, host_profile):
        print(f"\n## {check.__name__}", flush=True)
        try:
            check()
        except Exception as error:  # one check's failure leaves the others to run
            print(f"FAILED: {type(error).__name__}: {error}")
        sys.stdout.flush()
