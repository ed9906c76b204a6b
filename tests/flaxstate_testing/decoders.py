"""A tiny Llama/Qwen3-style decoder, NNX and linen, whose attention kernels are 3-D, and its weights as HF's files
hold them: names and shapes as transformers' Llama and Qwen3 write them, and the map between the two.

The expected arrays (`held`) are rearranged by hand with numpy's reshape and transpose, apart from einops, so that
a test checks the maps' layouts against HF's layouts and not against themselves.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS = 32, 16, 4, 2, 4, 24, 2


def _attend(q, k, v):
    """Causal grouped-query attention: q (b t h d), k and v (b t kv d)."""
    k, v = (jnp.repeat(x, HEADS // KV_HEADS, axis=2) for x in (k, v))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(HEAD_DIM)
    causal = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", weights, v)


class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.input_norm = nnx.RMSNorm(EMBED, rngs=rngs)
        self.q = nnx.LinearGeneral(EMBED, (HEADS, HEAD_DIM), use_bias=False, rngs=rngs)
        self.k = nnx.LinearGeneral(EMBED, (KV_HEADS, HEAD_DIM), use_bias=False, rngs=rngs)
        self.v = nnx.LinearGeneral(EMBED, (KV_HEADS, HEAD_DIM), use_bias=False, rngs=rngs)
        self.q_norm = nnx.RMSNorm(HEAD_DIM, rngs=rngs)
        self.o = nnx.LinearGeneral((HEADS, HEAD_DIM), EMBED, axis=(-2, -1), use_bias=False, rngs=rngs)
        self.post_norm = nnx.RMSNorm(EMBED, rngs=rngs)
        self.gate = nnx.Linear(EMBED, HIDDEN, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(EMBED, HIDDEN, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, EMBED, use_bias=False, rngs=rngs)

    def __call__(self, x):
        h = self.input_norm(x)
        x = x + self.o(_attend(self.q_norm(self.q(h)), self.k(h), self.v(h)))
        h = self.post_norm(x)
        return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


class NNXDecoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
        self.layers = nnx.List([NNXBlock(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(EMBED, rngs=rngs)
        self.lm_head = nnx.Linear(EMBED, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.RMSNorm(name="input_norm")(x)
        q = nn.RMSNorm(name="q_norm")(nn.DenseGeneral((HEADS, HEAD_DIM), use_bias=False, name="q")(h))
        k = nn.DenseGeneral((KV_HEADS, HEAD_DIM), use_bias=False, name="k")(h)
        v = nn.DenseGeneral((KV_HEADS, HEAD_DIM), use_bias=False, name="v")(h)
        x = x + nn.DenseGeneral(EMBED, axis=(-2, -1), use_bias=False, name="o")(_attend(q, k, v))
        h = nn.RMSNorm(name="post_norm")(x)
        gated = nn.silu(nn.Dense(HIDDEN, use_bias=False, name="gate")(h)) * nn.Dense(HIDDEN, use_bias=False, name="up")(
            h
        )
        return x + nn.Dense(EMBED, use_bias=False, name="down")(gated)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, EMBED, name="embed")(tokens)
        for i in range(LAYERS):
            x = Block(name=f"layers_{i}")(x)
        return nn.Dense(VOCAB, use_bias=False, name="lm_head")(nn.RMSNorm(name="norm")(x))


def init(api: str):
    """The decoder of `api` ("linen" or "nnx") and what `TrainLoop`/`SafetensorsReader` take as its init."""
    if api == "nnx":
        model = NNXDecoder(nnx.Rngs(0))
        return model, model
    model = Decoder()
    return model, model.init


def template(api: str):
    """The params' tree of the decoder as `jax.ShapeDtypeStruct`s."""
    if api == "nnx":
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
            nnx.state(NNXDecoder(nnx.Rngs(0)), nnx.Param).to_pure_dict(),
        )
    return jax.eval_shape(Decoder().init, jax.random.key(0), np.zeros((1, 4), np.int32))["params"]


def weight_map(api: str, tied: bool) -> dict:
    """The rules from the decoder's tree paths to HF's names and layouts (`lm_head` tied to the embedding or not)."""
    layer = "layers/{i}" if api == "nnx" else "layers_{i}"
    hf = "model.layers.{i}"
    return {
        "embed/embedding": "model.embed_tokens.weight",
        f"{layer}/input_norm/scale": f"{hf}.input_layernorm.weight",
        f"{layer}/q/kernel": (f"{hf}.self_attn.q_proj.weight", "(h d) e -> e h d"),
        f"{layer}/k/kernel": (f"{hf}.self_attn.k_proj.weight", "(h d) e -> e h d"),
        f"{layer}/v/kernel": (f"{hf}.self_attn.v_proj.weight", "(h d) e -> e h d"),
        f"{layer}/q_norm/scale": f"{hf}.self_attn.q_norm.weight",
        f"{layer}/o/kernel": (f"{hf}.self_attn.o_proj.weight", "e (h d) -> h d e"),
        f"{layer}/post_norm/scale": f"{hf}.post_attention_layernorm.weight",
        **{f"{layer}/{proj}/kernel": (f"{hf}.mlp.{proj}_proj.weight", "o i -> i o") for proj in ("gate", "up", "down")},
        "norm/scale": "model.norm.weight",
        "lm_head/kernel": ("model.embed_tokens.weight" if tied else "lm_head.weight", "v e -> e v"),
    }


def hf_tensors(tied: bool, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Random weights in HF's names and shapes, as `save_pretrained` writes a Qwen3 (`tied`: no `lm_head.weight`)."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.normal(size=shape).astype(dtype)

    tensors = {"model.embed_tokens.weight": normal(VOCAB, EMBED), "model.norm.weight": normal(EMBED)}
    for i in range(LAYERS):
        hf = f"model.layers.{i}"
        tensors |= {
            f"{hf}.input_layernorm.weight": normal(EMBED),
            f"{hf}.self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, EMBED),
            f"{hf}.self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, EMBED),
            f"{hf}.self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, EMBED),
            f"{hf}.self_attn.q_norm.weight": normal(HEAD_DIM),
            f"{hf}.self_attn.o_proj.weight": normal(EMBED, HEADS * HEAD_DIM),
            f"{hf}.post_attention_layernorm.weight": normal(EMBED),
            f"{hf}.mlp.gate_proj.weight": normal(HIDDEN, EMBED),
            f"{hf}.mlp.up_proj.weight": normal(HIDDEN, EMBED),
            f"{hf}.mlp.down_proj.weight": normal(EMBED, HIDDEN),
        }
    if not tied:
        tensors["lm_head.weight"] = normal(VOCAB, EMBED)
    return tensors


def held(api: str, tensors: dict[str, np.ndarray], tied: bool) -> dict[str, np.ndarray]:
    """The params' flat tree (`/`-joined paths) that HF's tensors make, rearranged by hand."""
    layer = "layers/{}" if api == "nnx" else "layers_{}"
    heads = {"q": HEADS, "k": KV_HEADS, "v": KV_HEADS}
    params = {
        "embed/embedding": tensors["model.embed_tokens.weight"],
        "norm/scale": tensors["model.norm.weight"],
        "lm_head/kernel": tensors["model.embed_tokens.weight" if tied else "lm_head.weight"].T,
    }
    for i in range(LAYERS):
        hf, at = f"model.layers.{i}", layer.format(i)
        for proj, n in heads.items():  # (n * d, e): row n * d + j is head n's j-th
            params[f"{at}/{proj}/kernel"] = (
                tensors[f"{hf}.self_attn.{proj}_proj.weight"].reshape(n, HEAD_DIM, EMBED).transpose(2, 0, 1)
            )
        params[f"{at}/o/kernel"] = (
            tensors[f"{hf}.self_attn.o_proj.weight"].reshape(EMBED, HEADS, HEAD_DIM).transpose(1, 2, 0)
        )
        params[f"{at}/q_norm/scale"] = tensors[f"{hf}.self_attn.q_norm.weight"]
        params[f"{at}/input_norm/scale"] = tensors[f"{hf}.input_layernorm.weight"]
        params[f"{at}/post_norm/scale"] = tensors[f"{hf}.post_attention_layernorm.weight"]
        for proj in ("gate", "up", "down"):
            params[f"{at}/{proj}/kernel"] = tensors[f"{hf}.mlp.{proj}_proj.weight"].T
    return params


def token_batches(n_batches: int, batch_size: int = 4, length: int = 8, seed: int = 0):
    """Deterministic `(tokens, next tokens)` batches."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(n_batches):
        tokens = rng.integers(0, VOCAB, (batch_size, length + 1)).astype(np.int32)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def cross_entropy(logits, targets):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))


class ShardedEinsum(nnx.Module):
    """A kernel of any rank, named by logical axes, applied as bonsai's `Einsum` is: its output's sharding named
    (`out_sharding=`, a bare `PartitionSpec` that needs the mesh context)."""

    def __init__(self, equation: str, shape: tuple[int, ...], axes: tuple[str | None, ...], rngs: nnx.Rngs) -> None:
        self.equation = equation
        init = nnx.with_partitioning(
            nnx.initializers.lecun_normal(in_axis=0, out_axis=tuple(range(1, len(shape)))), axes
        )
        self.kernel = nnx.Param(init(rngs.params(), shape))

    def __call__(self, x: jax.Array, out: P) -> jax.Array:
        return jnp.einsum(self.equation, x, self.kernel[...], out_sharding=out)


class ExplicitBlock(nnx.Module):
    """`NNXBlock` as jax-ml/bonsai writes its sharded Qwen3: 3-D attention kernels sharded over `fsdp` on their
    embedding axis, every product's output sharding named, and the keys and values written into a KV cache that
    is made zeros with a `PartitionSpec` (which only the mesh context resolves) and read back in the attention."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.input_norm = nnx.RMSNorm(EMBED, rngs=rngs)
        self.q = ShardedEinsum("btd,dhk->bthk", (EMBED, HEADS, HEAD_DIM), ("embed", None, None), rngs)
        self.k = ShardedEinsum("btd,dhk->bthk", (EMBED, KV_HEADS, HEAD_DIM), ("embed", None, None), rngs)
        self.v = ShardedEinsum("btd,dhk->bthk", (EMBED, KV_HEADS, HEAD_DIM), ("embed", None, None), rngs)
        self.o = ShardedEinsum("bthk,hkd->btd", (HEADS, HEAD_DIM, EMBED), (None, None, "embed"), rngs)
        self.post_norm = nnx.RMSNorm(EMBED, rngs=rngs)
        self.gate = ShardedEinsum("btd,df->btf", (EMBED, HIDDEN), ("embed", None), rngs)
        self.up = ShardedEinsum("btd,df->btf", (EMBED, HIDDEN), ("embed", None), rngs)
        self.down = ShardedEinsum("btf,fd->btd", (HIDDEN, EMBED), (None, "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        heads, rows = P("fsdp", None, None, None), P("fsdp", None, None)
        h = self.input_norm(x)
        q, k, v = self.q(h, heads), self.k(h, heads), self.v(h, heads)
        cache = [jnp.zeros((x.shape[0], x.shape[1], KV_HEADS, HEAD_DIM), x.dtype, out_sharding=heads) for _ in "kv"]
        k, v = (jax.lax.dynamic_update_slice(each, new, (0, 0, 0, 0)) for each, new in zip(cache, (k, v), strict=True))
        x = x + self.o(_attend(q, k, v), rows)
        h = self.post_norm(x)
        return x + self.down(nnx.silu(self.gate(h, rows)) * self.up(h, rows), rows)


class ExplicitDecoder(nnx.Module):
    """`NNXDecoder` in bonsai's style (`ExplicitBlock`), for a mesh with an `fsdp` axis, set as the context."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = ShardedEinsum("btv,vd->btd", (VOCAB, EMBED), (None, "embed"), rngs)
        self.layers = nnx.List([ExplicitBlock(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(EMBED, rngs=rngs)
        self.lm_head = ShardedEinsum("btd,dv->btv", (EMBED, VOCAB), ("embed", None), rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        rows = P("fsdp", None, None)
        x = self.embed(jax.nn.one_hot(tokens, VOCAB), rows)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x), rows)


EXPLICIT_RULES = (("batch", "fsdp"), ("embed", "fsdp"))
"""`ExplicitDecoder`'s logical axes on a mesh of one axis, `fsdp`: the batch's rows, and each kernel's embedding."""
