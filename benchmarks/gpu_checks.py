"""Checks that need a GPU, each printed as it ends: what issue 58 asks of a lent GPU beside the timings.

1. The model FLOPs of the LM example's step are the same with cuDNN's fused
   attention as with XLA's (`throughput.model_flops` counts the fused kernel's
   products as the unfused attention's).
2. Where the host's time goes at K=1 and K=10 (cProfile, the top functions by
   their own time), on the small MLP of `loop_overhead.py`.

    python benchmarks/gpu_checks.py

Transfers between records are `guard_check.py`'s (the guard at "disallow"; at "log" it logged nothing on an H200).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
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
    for check in (fused_attention_count, host_profile):
        print(f"\n## {check.__name__}", flush=True)
        try:
            check()
        except Exception as error:  # one check's failure leaves the others to run
            print(f"FAILED: {type(error).__name__}: {error}")
        sys.stdout.flush()
