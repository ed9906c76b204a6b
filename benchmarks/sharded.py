"""Sharded training: flaxstate's loop against a hand-written `jax.jit` loop with the same shardings.

The LM example's transformer (`examples/lm.py`), its state sharded by its
logical axes through the example's rules over a mesh of this process's
devices (`--mesh`, by default FSDP over all of them: one device on a CPU).
The hand-written loop is what a careful user writes: flax's
`get_partition_spec` and `logical_to_mesh_sharding` for the parameters, the
optimizer state given its parameter's sharding (`optax.tree_map_params`),
one `jax.jit` step with explicit shardings and the state donated. Both train
on the same batches, held in memory, in alternating rounds of `--steps`
steps (flaxstate: one record a round, its host copy included); the table
gives the median seconds a step and the ratio. With `--peak-tflops` (or on a
GPU this script knows) it adds model FLOPs utilisation: 6 x parameters x
tokens a second / peak FLOP/s, and the MFU flaxstate's records report (XLA's
FLOPs of the step over the device's dense bfloat16 peak). Where the device
reports its memory (a GPU), it also gives flaxstate's peak device memory,
measured before the hand-written loop exists, against `fs.plan`'s "local"
plan of the same job.

    python benchmarks/sharded.py [--rounds 15] [--steps 100] [--mesh fsdp=N] [--embed 256 --layers 4 ...]
        [--dtype bfloat16] [-v]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import statistics
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax

import flaxstate as fs

PEAK_TFLOPS = {
    "float32": {"NVIDIA H100 80GB HBM3": 494.7, "NVIDIA H200": 494.7},
    "bfloat16": {"NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H200": 989.0},
}
"""Dense peaks by the model's dtype (float32 matmuls run in TF32 on these GPUs by JAX's default precision)."""


def load_example():
    path = Path(__file__).parents[1] / "examples" / "lm.py"
    spec = importlib.util.spec_from_file_location("lm_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["lm_example"] = module
    spec.loader.exec_module(module)
    return module


lm = load_example()


class HandWritten:
    """A jit loop with the example's shardings: params and adam state by logical axes, state donated."""

    def __init__(self, model: nn.Module, config, mesh, sample: np.ndarray) -> None:
        tx = lm.optimizer(config)
        boxed = jax.eval_shape(model.init, jax.random.key(0), sample)
        specs = nn.get_partition_spec(boxed)["params"]
        param_shardings = nn.logical_to_mesh_sharding(specs, mesh, lm.RULES)
        abstract_opt = jax.eval_shape(lambda p: tx.init(p), nn.unbox(boxed)["params"])
        opt_shardings = optax.tree_map_params(
            tx,
            lambda _, sharding: sharding,
            abstract_opt,
            param_shardings,
            transform_non_params=lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
            is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding),
        )
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        batch = nn.logical_to_mesh_sharding(jax.sharding.PartitionSpec("batch"), mesh, lm.RULES)

        def init(rng):
            params = nn.unbox(model.init(rng, sample))["params"]
            return params, tx.init(params)

        self.params, self.opt_state = jax.jit(init, out_shardings=(param_shardings, opt_shardings))(jax.random.key(0))

        def step(params, opt_state, inputs, targets):
            def loss_fn(p):
                return lm.loss(model.apply({"params": p}, inputs), targets)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._step = jax.jit(
            step,
            in_shardings=(param_shardings, opt_shardings, batch, batch),
            out_shardings=(param_shardings, opt_shardings, replicated),
            donate_argnums=(0, 1),
        )

    def run(self, batches) -> float:
        loss = None
        for inputs, targets in batches:
            self.params, self.opt_state, loss = self._step(self.params, self.opt_state, inputs, targets)
        return float(loss)


def largest_batch(model: nn.Module, config, mesh, per_dispatch: int, step: int = 8, spare: float = 0.1) -> int:
    """The largest batch (a multiple of `step`) whose training `fs.plan` says fits on the devices with `spare` of
    their memory to spare: planned at two batches, the total's line through them, then planned at the batch the
    line gives, `step` fewer until it fits.

    With nothing to spare, on an H200 the plan's batch of GPT-2 small's shape (101.6 of 104.9 GiB) ran out of
    device memory in flaxstate's loop (one allocation of 99.8 GiB failed), where the hand-written loop ran.
    """

    def planned(batch_size: int) -> fs.Plan:
        sized = dataclasses.replace(config, batch_size=batch_size)
        task = fs.TrainTask(apply=model.apply, optimizer=lm.optimizer(sized), loss=lm.loss, data=iter(()))
        return fs.plan(
            model.init,
            task,
            target="local",
            mesh_shape=dict(mesh.shape),
            axis_rules=lm.RULES,
            batch=lm.batches(lm.text(), sized).batch(0),
            n_steps_per_dispatch=per_dispatch,
        )

    low, high = planned(step), planned(2 * step)
    if low.device_memory is None:
        raise SystemExit("--batch-size 0 needs a device that reports its memory (a GPU).")
    slope = (high.per_device["total"] - low.per_device["total"]) / step
    base = low.per_device["total"] - slope * step
    usable = low.device_memory * (1 - spare)
    batch = max(step, int((usable - base) / slope) // step * step)
    while batch > step:
        chosen = planned(batch)
        fits = chosen.per_device["total"] <= usable
        print(
            f"fs.plan at batch {batch}: {chosen.per_device['total'] / 2**30:.2f} GiB a device of "
            f"{chosen.device_memory / 2**30:.2f} GiB: {'fits' if fits else 'does not fit'} with {spare:.0%} to spare"
        )
        if fits:
            break
        batch -= step
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=100, help="steps a round (a record a round, as examples/lm.py)")
    parser.add_argument("--mesh", default=f"fsdp={jax.device_count()}")
    parser.add_argument("--batch-size", type=int, default=16, help="0: the largest that fs.plan says fits, 10%% spare")
    parser.add_argument("--batch-to", type=Path, default=None, help="write the batch size used to this file")
    parser.add_argument("--vocab", type=int, default=256, help="the model's vocabulary (GPT-2's: 50257)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--mlp", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--record-memory", default="host", choices=("host", "device"), help="records' copies")
    parser.add_argument("--no-plan", action="store_true", help="skip fs.plan's local plan on a GPU")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="activations' dtype")
    parser.add_argument("--per-dispatch", type=int, default=1, help="flaxstate's n_steps_per_dispatch")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the devices' peak, for MFU")
    parser.add_argument("--attention", default="flax", choices=("flax", "xla", "cudnn"), help="the example's")
    parser.add_argument("--scan-layers", action="store_true", help="the blocks under nn.scan")
    parser.add_argument(
        "--only", choices=("flaxstate", "hand-written"), help="one contender, alone in this process (no ratio)"
    )
    parser.add_argument("-v", action="store_true", help="print every round")
    args = parser.parse_args()
    config = lm.Config(
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        embed=args.embed,
        heads=args.heads,
        head_dim=args.head_dim,
        mlp=args.mlp,
        layers=args.layers,
        dtype=args.dtype,
        attention=args.attention,
        scan_layers=args.scan_layers,
        vocab=args.vocab,
    )
    mesh = lm.make_mesh(args.mesh)
    model = lm.Transformer(config)
    if args.batch_size == 0:
        config = dataclasses.replace(config, batch_size=largest_batch(model, config, mesh, args.per_dispatch))
    if args.batch_to is not None:
        args.batch_to.write_text(str(config.batch_size))
    dataset = lm.batches(lm.text(), config)
    batches = [dataset.batch(index) for index in range(args.steps * 2)]

    task = fs.TrainTask(apply=model.apply, optimizer=lm.optimizer(config), loss=lm.loss, data=itertools.cycle(batches))
    plan = None
    # Compiled only, before anything is on the device.
    if not args.no_plan and jax.devices()[0].memory_stats() is not None:
        plan = fs.plan(
            model.init,
            task,
            target="local",
            mesh_shape=dict(mesh.shape),
            axis_rules=lm.RULES,
            batch=batches[0],
            n_steps_per_dispatch=args.per_dispatch,
        )
    shapes = jax.eval_shape(model.init, jax.random.key(0), batches[0][0][:1])["params"]
    n_params = sum(leaf.size for leaf in jax.tree.leaves(nn.unbox(shapes)))
    contenders = {}
    records: list = []
    flaxstate_peak = None
    if args.only != "hand-written":
        loop = fs.TrainLoop(
            init=model.init,
            task=task,
            rng=0,
            n_steps=10**9,
            n_steps_per_checkpoint=args.steps,
            n_steps_per_dispatch=args.per_dispatch,
            record_memory=args.record_memory,
            peak_flops_per_device=args.peak_tflops * 1e12 if args.peak_tflops else None,
            stdout=False,
            mesh=mesh,
            axis_rules=lm.RULES,
        )
        started = time.perf_counter()
        loop.next_checkpoint()  # compiled and warm
        print(f"flaxstate's first record (compiling included): {time.perf_counter() - started:.1f} s")
        stats = jax.devices()[0].memory_stats()
        flaxstate_peak = stats and stats.get("peak_bytes_in_use")  # before the hand-written loop exists

        def flaxstate_round() -> None:
            records.append(loop.next_checkpoint())

        contenders["flaxstate TrainLoop"] = flaxstate_round
    if args.only != "flaxstate":
        started = time.perf_counter()
        hand = HandWritten(model, config, mesh, batches[0][0][:1])
        rounds = itertools.cycle([batches[: args.steps], batches[args.steps :]])
        hand.run(next(rounds))
        print(f"the hand-written loop's first round (compiling included): {time.perf_counter() - started:.1f} s")
        contenders["hand-written jax.jit"] = lambda: hand.run(next(rounds))
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for index in range(args.rounds):
        for name in list(contenders) if index % 2 == 0 else list(reversed(contenders)):
            start = time.perf_counter()
            contenders[name]()
            times[name].append((time.perf_counter() - start) / args.steps)
    if args.v:
        print({name: [round(x * 1e3, 1) for x in values] for name, values in times.items()})
    tokens = config.batch_size * config.seq_len
    device = jax.devices()[0].device_kind
    peak = args.peak_tflops or PEAK_TFLOPS[args.dtype].get(device)
    sizes = {key: getattr(config, key) for key in ("embed", "heads", "head_dim", "mlp", "layers", "seq_len", "vocab")}
    print(
        f"jax {jax.__version__}, {jax.device_count()} x {device}; mesh {dict(mesh.shape)}; LM {sizes} "
        f"({n_params / 1e6:.2f}M parameters, adamw, {args.dtype} activations), batch {config.batch_size} "
        f"({tokens} tokens a step), "
        f"{args.rounds} alternating rounds of {args.steps} steps (flaxstate: one record a round)\n"
    )
    print(
        "| loop | ms a step (median) | tokens/s | x hand-written throughput (median of rounds) |"
        + (" MFU |" if peak else "")
    )
    print("|---|---:|---:|---:|" + ("---:|" if peak else ""))
    hand = times.get("hand-written jax.jit")
    for name, values in times.items():
        median = statistics.median(values)
        ratio = statistics.median(h / v for h, v in zip(hand, values, strict=True)) if hand else None  # each round's
        mfu = f" {6 * n_params * tokens / median / (peak * 1e12):.1%} |" if peak else ""
        shown = "-" if ratio is None else f"{ratio:.3f}x"
        print(f"| {name} | {median * 1e3:.2f} | {tokens / median:,.0f} | {shown} |{mfu}")
    if records:
        record = records[-1]
        six_nd = 6 * n_params * tokens
        print(
            f"\nflaxstate's records: model FLOPs a step {record.flops_per_step:.4g} "
            f"({record.flops_per_step / six_nd:.3f}x "
            f"6ND = {six_nd:.4g}), XLA's {record.xla_flops_per_step or float('nan'):.4g}; MFU median "
            + (f"{statistics.median(r.mfu for r in records):.1%}" if record.mfu is not None else "unknown")
            + f"; device peak {(record.device_memory_peak or 0) / 2**30:.2f} GiB, host {record.host_memory / 2**30:.2f}"
            f" GiB (peak {record.host_memory_peak / 2**30:.2f})"
        )
    if plan is not None and flaxstate_peak:
        total = plan.per_device["total"]
        print(
            f"\npeak device memory of flaxstate's loop: {flaxstate_peak / 2**30:.2f} GiB measured; fs.plan('local') "
            f"{total / 2**30:.2f} GiB ({total / flaxstate_peak:.2f}x; params "
            f"{plan.per_device['params'] / 2**30:.2f}, optimizer {plan.per_device['optimizer'] / 2**30:.2f}, "
            f"temp {plan.per_device['temp'] / 2**30:.2f} GiB)"
        )


if __name__ == "__main__":
    main()
