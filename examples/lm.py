"""Trains a small decoder-only transformer language model, sharded over a mesh, with flaxstate.

The text is Python's own reference documentation (`pydoc_data.topics`, which
ships with Python: no download), read as bytes (a vocabulary of 256). Every
parameter names its logical axes (`embed`, `mlp`, `heads`, `kv`, `vocab`);
`--mesh` sizes the mesh axes `data`, `fsdp` and `model`, and `RULES` maps the
names onto them: FSDP shards `embed` over `fsdp`, tensor parallelism shards
`mlp`, `heads` and `vocab` over `model`. The last `HELD_OUT` of the text is
never trained on: each record is evaluated on it (`eval/loss`) by an
`EvalLoop` sharded as the training is. Checkpoints, resume and TensorBoard
logs land in --output-dir, with the settings as the checkpoint's metadata.

    python examples/lm.py --steps 300 --output-dir runs/lm

Its params leave as an HF-style safetensors folder (names and layouts from
`HF_MAP`, a `fs.WeightMap`), and a fine-tune starts from one (`--init-from`),
resuming its own checkpoints:

    PYTHONPATH=examples python -c "import lm; print(lm.HF_MAP.to_json(), end='')" > lm-hf.json
    flaxstate export runs/lm export/lm --map lm-hf.json
    python examples/lm.py --init-from export/lm --output-dir runs/tuned

Two processes on one machine, FSDP (each feeds half of the batch) or
tensor-parallel (each feeds the whole batch):

    python examples/lm.py --mesh data=1,fsdp=2,model=1 --num-processes 2 --process-id 0 \
        --coordinator-address 127.0.0.1:12355 &
    python examples/lm.py --mesh data=1,fsdp=2,model=1 --num-processes 2 --process-id 1 \
        --coordinator-address 127.0.0.1:12355

The settings are one dataclass, `Config`, read with tyro: `--help` lists every
field with its docstring. tyro over draccus and ml_collections: it builds the
command line from the typed dataclass alone (no registry, no YAML, no absl
flags), checks the types, and the dataclass stays a plain frozen dataclass
that `CheckpointFileWriter(metadata=...)` stores as JSON.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import redex
import tyro
from jax.sharding import Mesh

import flaxstate as fs

RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("vocab", "model"),
    ("layers", None),
)
"""Logical axes to mesh axes: the batch over data and fsdp, FSDP over embed, tensor parallelism over the rest
(`layers`, the stacked blocks' axis under `--scan-layers`, on no mesh axis)."""

MESH_AXES = ("data", "fsdp", "model")


@dataclasses.dataclass(frozen=True)
class Config:
    """A small character-level transformer on Python's reference documentation."""

    steps: int = 300
    """Total training steps."""
    output_dir: str = "runs/lm"
    """Checkpoints and TensorBoard logs; a second run resumes from the newest checkpoint."""
    mesh: str = "data=1,fsdp=1,model=1"
    """Mesh axis sizes, e.g. data=1,fsdp=2,model=1 (FSDP) or data=1,fsdp=1,model=2 (tensor-parallel)."""
    batch_size: int = 16
    """Global batch size (sequences a step)."""
    seq_len: int = 64
    """Tokens (bytes) a sequence."""
    embed: int = 64
    """Model width (logical axis embed)."""
    heads: int = 4
    """Attention heads (logical axis heads)."""
    head_dim: int = 16
    """Width of a head (logical axis kv)."""
    mlp: int = 256
    """Hidden width of each block's MLP (logical axis mlp)."""
    layers: int = 2
    """Transformer blocks."""
    dtype: str = "float32"
    """The activations' and matrix products' dtype (float32 or bfloat16); parameters and the optimizer stay float32."""
    attention: Literal["flax", "xla", "cudnn"] = "flax"
    """flax's dot_product_attention (the scores materialised), or jax.nn.dot_product_attention by XLA or by
    cuDNN's fused kernel (a GPU, bfloat16)."""
    scan_layers: bool = False
    """The blocks as one nn.scan over stacked parameters (compiled once, not once a layer); another checkpoint
    layout."""
    vocab: int = 256
    """Token embeddings and logits: 256, the bytes; more only to give the model a real tokenizer's shape (GPT-2's
    50257) while the text stays bytes."""
    learning_rate: float = 3e-3
    """AdamW's learning rate."""
    steps_per_checkpoint: int = 100
    """A record (logged, saved) every this many steps."""
    steps_per_dispatch: int = 10
    """Steps in one compiled call."""
    eval_batches: int = 4
    """Held-out batches evaluated at every record."""
    seed: int = 0
    """The run's seed: initialization and the data's order."""
    init_from: str | None = None
    """A safetensors export (a file, or a folder) with the names `HF` gives, to fine-tune from: the params from
    there and a fresh optimizer state, where --output-dir holds no checkpoint yet (one it holds is resumed)."""
    coordinator_address: str | None = os.environ.get("JAX_COORDINATOR_ADDRESS")
    """host:port of process 0, for several processes (or JAX_COORDINATOR_ADDRESS)."""
    num_processes: int = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    """How many processes join (or JAX_NUM_PROCESSES)."""
    process_id: int = int(os.environ.get("JAX_PROCESS_ID", "0"))
    """This process's index (or JAX_PROCESS_ID)."""


VOCAB = 256
"""Bytes: the text's vocabulary (`Config.vocab`'s default)."""

HF_MAP = fs.WeightMap(
    {
        "Embed_0/embedding": "model.embed_tokens.weight",
        "position": "model.embed_positions.weight",
        "Block_{i}/RMSNorm_0/scale": "model.layers.{i}.input_layernorm.weight",
        "Block_{i}/DenseGeneral_0/kernel": ("model.layers.{i}.self_attn.q_proj.weight", "(h d) e -> e h d"),
        "Block_{i}/DenseGeneral_1/kernel": ("model.layers.{i}.self_attn.k_proj.weight", "(h d) e -> e h d"),
        "Block_{i}/DenseGeneral_2/kernel": ("model.layers.{i}.self_attn.v_proj.weight", "(h d) e -> e h d"),
        "Block_{i}/DenseGeneral_3/kernel": ("model.layers.{i}.self_attn.o_proj.weight", "e (h d) -> h d e"),
        "Block_{i}/RMSNorm_1/scale": "model.layers.{i}.post_attention_layernorm.weight",
        "Block_{i}/Dense_0/kernel": ("model.layers.{i}.mlp.up_proj.weight", "o i -> i o"),
        "Block_{i}/Dense_0/bias": "model.layers.{i}.mlp.up_proj.bias",
        "Block_{i}/Dense_1/kernel": ("model.layers.{i}.mlp.down_proj.weight", "o i -> i o"),
        "Block_{i}/Dense_1/bias": "model.layers.{i}.mlp.down_proj.bias",
        "RMSNorm_0/scale": "model.norm.weight",
        "Dense_0/kernel": ("lm_head.weight", "v e -> e v"),
    }
)
"""The params' tree paths and their names and layouts in an HF-style export, read both ways: transformers' Llama
names and shapes, for the layers' own layout (without `--scan-layers`). The attention projections are held
`(embed, heads, head_dim)` (and `o` `(heads, head_dim, embed)`) and stored as HF's 2-D `(heads * head_dim, embed)`;
the other 2-D kernels are stored `(out, in)`."""


HELD_OUT = 0.05
"""The share of the text, at its end, kept for evaluation."""


NORMAL = nn.initializers.normal(0.02)


def _init(axes: tuple[str | None, ...], init: nn.initializers.Initializer = NORMAL) -> nn.initializers.Initializer:
    """`init`, its parameter named by logical axes (one name, or `None`, a dimension)."""
    return nn.with_logical_partitioning(init, axes)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        norm = _init(("embed",), nn.initializers.ones)
        h = nn.RMSNorm(scale_init=norm, dtype=dtype)(x)
        q, k, v = (
            nn.DenseGeneral(
                (c.heads, c.head_dim), use_bias=False, kernel_init=_init(("embed", "heads", "kv")), dtype=dtype
            )(h)
            for _ in range(3)
        )
        if c.attention == "flax":
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
            attended = nn.dot_product_attention(q, k, v, mask=mask)
        else:  # (batch, tokens, heads, head_dim), as jax's BTNH layout
            attended = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=c.attention)
        x = x + nn.DenseGeneral(
            c.embed, axis=(-2, -1), use_bias=False, kernel_init=_init(("heads", "kv", "embed")), dtype=dtype
        )(attended)
        h = nn.RMSNorm(scale_init=norm, dtype=dtype)(x)
        zeros = nn.initializers.zeros
        h = nn.Dense(c.mlp, kernel_init=_init(("embed", "mlp")), bias_init=_init(("mlp",), zeros), dtype=dtype)(h)
        h = nn.Dense(c.embed, kernel_init=_init(("mlp", "embed")), bias_init=_init(("embed",), zeros), dtype=dtype)(
            nn.gelu(h)
        )
        return x + h


class ScannedBlock(nn.Module):
    """A `Block` as `nn.scan` takes it: (carry, input) to (carry, output)."""

    config: Config

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        return Block(self.config)(x), None


class Transformer(nn.Module):
    """Decoder-only: token and position embeddings, `layers` blocks, a final norm, logits over bytes."""

    config: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        x = nn.Embed(c.vocab, c.embed, embedding_init=_init(("vocab", "embed")), dtype=dtype)(tokens)
        position = self.param("position", _init((None, "embed")), (c.seq_len, c.embed))
        x = x + position[: tokens.shape[1]].astype(dtype)
        if c.scan_layers:
            stack = nn.scan(
                ScannedBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=c.layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = stack(c, name="layers")(x, None)
        else:
            for _ in range(c.layers):
                x = Block(c)(x)
        x = nn.RMSNorm(scale_init=_init(("embed",), nn.initializers.ones), dtype=dtype)(x)
        return nn.Dense(c.vocab, use_bias=False, kernel_init=_init(("embed", "vocab")), dtype=dtype)(x)


def loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy, in nats."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def optimizer(config: Config) -> optax.GradientTransformation:
    """AdamW at the configured learning rate."""
    return optax.adamw(config.learning_rate)


def text() -> np.ndarray:
    """Python's reference documentation as bytes (about 1 MB; it ships with Python)."""
    from pydoc_data.topics import topics

    return np.frombuffer("\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8"), dtype=np.uint8)


def split(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The text to train on and the held-out text after it (`HELD_OUT` of it)."""
    cut = int(len(tokens) * (1 - HELD_OUT))
    return tokens[:cut], tokens[cut:]


def windows(tokens: np.ndarray, config: Config) -> tuple[np.ndarray, np.ndarray]:
    """Every window of `seq_len + 1` bytes as (inputs, next bytes): two views of the tokens, nothing copied."""
    rows = np.lib.stride_tricks.sliding_window_view(tokens.astype(np.int32), config.seq_len + 1)
    return rows[:, :-1], rows[:, 1:]


def batches(tokens: np.ndarray, config: Config, mesh: Mesh | None = None) -> fs.GlobalBatches:
    """Batches of (inputs, next bytes): every window once an epoch, in a new seeded order each epoch.

    Global batch s is the same windows on any number of processes; with the
    loop's `mesh`, each process reads only the part of it that its devices
    hold (FSDP: half each over 2 processes; tensor-parallel: all), and a
    resume starts at its step without reading the batches before it.
    """
    rules = RULES if mesh is not None else None
    return fs.global_batches(windows(tokens, config), config.batch_size, seed=config.seed, mesh=mesh, axis_rules=rules)


def make_mesh(spec: str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh from 'data=1,fsdp=2,model=1' (axes left out have size 1) over the devices (all by default).

    Raises:
        ValueError: an unknown axis, or sizes whose product is not the device count.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = dict.fromkeys(MESH_AXES, 1)
    for item in filter(None, spec.split(",")):
        name, _, size = item.partition("=")
        if name.strip() not in sizes or not size.strip().isdigit():
            raise ValueError(
                f"--mesh takes axis=size pairs over {MESH_AXES}, e.g. data=1,fsdp=2,model=1; got {item!r}."
            )
        sizes[name.strip()] = int(size)
    shape = tuple(sizes.values())
    if int(np.prod(shape)) != len(devices):
        raise ValueError(f"--mesh {spec} has {int(np.prod(shape))} devices; this run has {len(devices)}.")
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def join_processes(config: Config) -> None:
    if config.num_processes > 1:
        # Before initialize, which must come before any call that starts a backend (jax.devices() included).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives; GPUs and TPUs ignore it
        jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)


def main(config: Config) -> None:
    join_processes(config)
    mesh = make_mesh(config.mesh)
    model = Transformer(config)
    train_tokens, held_out = split(text())
    held_out_batches = batches(held_out, config, mesh)
    start = model.init
    if config.init_from is not None:
        start = fs.SafetensorsReader(config.init_from, model.init, map=HF_MAP)
    loop = fs.TrainLoop(
        init=fs.CheckpointFileReader(config.output_dir, target=start),  # resume, or start from init or the files
        task=fs.TrainTask(
            apply=model.apply,
            optimizer=optimizer(config),
            loss=loss,
            data=batches(train_tokens, config, mesh),
        ),
        rng=jax.random.key(config.seed),
        n_steps=config.steps,
        n_steps_per_checkpoint=config.steps_per_checkpoint,
        n_steps_per_dispatch=config.steps_per_dispatch,
        mesh=mesh,
        axis_rules=RULES,
    )
    evaluate = fs.EvalLoop(
        fs.EvalTask(
            apply=model.apply,
            metrics={"loss": loss},
            data=[held_out_batches.batch(i) for i in range(config.eval_batches)],  # the same batches every time
        ),
        rng=jax.random.key(config.seed),
        n_steps=config.eval_batches,
        mesh=mesh,
        axis_rules=RULES,
    )
    process = redex.combinator.serial(
        evaluate,
        fs.SummaryLogger(),
        fs.SummaryWriter(config.output_dir),
        fs.CheckpointFileWriter(config.output_dir, keep=2, metadata=config),
    )
    for checkpoint in loop:
        process(checkpoint)


if __name__ == "__main__":
    main(tyro.cli(Config))
