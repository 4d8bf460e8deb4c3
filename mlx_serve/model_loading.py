"""Loading a model for the engine: resolve, check, load through mlx-lm, size the KV pool."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from mlx_serve.adapters import AdapterSet, install_adapters, unadapted
from mlx_serve.config import EngineConfig
from mlx_serve.errors import InvalidRequest, MlxServeError, ModelNotFound
from mlx_serve.kv_pool import KVLayout
from mlx_serve.mla_attention import expanded_latent_heads, mla_dims
from mlx_serve.model_source import cache_layers

if TYPE_CHECKING:
    from mlx_serve.recurrent import StateEntry

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    path: Path | None
    model_id: str
    config: dict
    weight_bytes: int
    layout: KVLayout
    context_length: int
    vocab_size: int
    adapters: AdapterSet | None = None  # LoRA adapters requests choose by name
    draft: Any = None  # the draft model speculative decoding asks (`--draft-model`), or None
    draft_bytes_per_token: int = 0  # what a token of its caches holds
    # each layer that keeps a recurrent state (`mlx_serve.recurrent`): the arrays a request's state holds there, as
    # probed once at load; empty: none
    state_shapes: dict[int, list[StateEntry | None]] = field(default_factory=dict)

    @property
    def state_layers(self) -> tuple[int, ...]:
        return tuple(self.state_shapes)

    @property
    def state_bytes(self) -> int:
        """What one request's state holds over the recurrent layers; 0: none."""
        return sum(math.prod(entry.shape) * entry.dtype.size for entries in self.state_shapes.values()
                   for entry in entries if entry is not None)  # fmt: skip


def load_model(config: EngineConfig) -> LoadedModel:
    from mlx_serve.checkpoints import default_model_path
    from mlx_serve.model_source import check_supported, resolve_model

    path = resolve_model(config.model) if config.model else default_model_path()
    model_config = read_config(path)
    check_supported(model_config)
    model, tokenizer = _load(path, config.adapter_path, chat_template_text(config.chat_template))
    model = text_model(model)
    _materialize(model, show_progress=config.progress, label=f"loading {path.name}")
    model_id = config.model or f"mlx-serve/{path.name}"
    return describe_model(model, tokenizer, model_config, model_id, config, path)


def describe_model(
    model: Any, tokenizer: Any, model_config: dict, model_id: str, config: EngineConfig, path: Path | None = None
) -> LoadedModel:
    """What the engine needs to know about a loaded mlx-lm model (also for models built in memory)."""
    from mlx_serve.model_source import chunked_layers, layer_windows, weight_bytes
    from mlx_serve.recurrent import recurrent_layers, state_layers, state_shapes

    model = text_model(model)
    windows = layer_windows(model)
    recurrent, stateful = recurrent_layers(model), state_layers(model)  # no K/V; a state (with K/V or not)
    if stateful:
        check_recurrent(model, stateful, config)
    adapters = install_adapters(model, config.adapters)
    # arrays a module keeps outside its parameters (SuScaledRoPE's frequencies) are still lazy: made on this thread,
    # MLX cannot evaluate them on the engine's
    mx.eval(module_buffers(model))
    args = model.args
    if len(recurrent) == len(cache_layers(model)):  # Mamba: no K/V at all (the pool's blocks only count positions)
        layout = KVLayout(len(recurrent), 1, 1, activation_dtype(model), recurrent=recurrent)
    else:
        layout = replace(kv_layout(model, windows), recurrent=recurrent, chunked=chunked_layers(model))
        layout = quantized_kv_layout(model, layout, config)
    if layout.latent:
        check_latent_attention(config)
    draft = load_draft(config.draft_model, int(args.vocab_size)) if config.draft_model else None
    # the text model's own (a multimodal checkpoint keeps it in text_config), else config.json's
    trained = getattr(args, "max_position_embeddings", None) or model_config.get("max_position_embeddings", 4096)
    context = config.max_model_len or int(trained)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=path,
        model_id=model_id,
        config=model_config,
        weight_bytes=weight_bytes(model),
        layout=layout,
        context_length=context,
        vocab_size=int(args.vocab_size),
        adapters=adapters,
        draft=draft,
        draft_bytes_per_token=kv_layout(draft).bytes_per_token() if draft is not None else 0,
        state_shapes=state_shapes(model, stateful) if stateful else {},
    )


def check_recurrent(model: Any, layers: tuple[int, ...], config: EngineConfig) -> None:
    """Refuse what a model with recurrent layers cannot do: a state is one array a request (nothing to roll a
    rejected draft back to), rows reach its mixers regrouped (no per-row adapters, no compiled or Core ML steps)."""
    from mlx_serve.recurrent import install_regrouped_mixers

    _refuse_for_lane_groups(config, "a model of recurrent layers", "a request's state is one array a layer, read in "
                            "order: no drafts to roll back, no per-row adapters, no compiled or Core ML steps", drafts=True)  # fmt: skip
    install_regrouped_mixers(model, layers)


def check_latent_attention(config: EngineConfig) -> None:
    """Refuse what multi-head latent attention cannot take: its forward runs per lane group, eager (`mla_attention`),
    so per-row adapters would meet rows out of the step's order."""
    _refuse_for_lane_groups(config, "multi-head latent attention", "its forward runs lane group by lane group, eager")


def _refuse_for_lane_groups(config: EngineConfig, model_kind: str, why: str, drafts: bool = False) -> None:
    """InvalidRequest for a setting a model whose modules read the step's rows regrouped by lane cannot take: per-row
    adapters, compiled or Core ML steps, and (`drafts`) drafts, where a state cannot be rolled back."""
    asked = {
        "speculative_tokens": drafts and (config.speculative_tokens > 0 or config.draft_model is not None),
        "lora": bool(config.adapters) or config.adapter_memory_gb > 0,
        "compile_decode": config.compile_decode == "on",
        "ane_lane": config.ane_lane != "off",
    }
    for param, on in asked.items():
        if on:
            raise InvalidRequest(f"{param}: not with {model_kind} ({why})", param=param)


def kv_layout(model: Any, windows: tuple[int | None, ...] = ()) -> KVLayout:
    """The K/V a token of the model's caches holds, each layer's window given."""
    args = model.args
    layers, dtype = len(cache_layers(model)), activation_dtype(model)
    if (latent := mla_dims(model)) is not None:  # one "head" a token: the latent as key, the RoPE key as value
        return KVLayout(layers, 1, latent.latent, dtype, windows, value_dim=latent.rope_key, latent=True)
    if (expanded := expanded_latent_heads(model)) is not None:  # keys of q_head_dim, values of v_head_dim, every head
        return KVLayout(layers, args.num_attention_heads, expanded.key, dtype, windows, value_dim=expanded.value)
    heads = _layer_heads(model)
    if len(set(heads)) == 1:  # the attention modules' own counts, where they give them (Step 3.5: attention groups)
        kv_heads, key, value = heads[0]
        return KVLayout(layers, kv_heads, key, dtype, windows, value_dim=value if value != key else 0)
    n_heads = getattr(args, "num_attention_heads", None) or args.n_head  # GPT-2 keeps its own names
    head_dim = getattr(args, "head_dim", None) or (getattr(args, "hidden_size", None) or args.n_embd) // n_heads
    kv_heads = getattr(args, "num_key_value_heads", None) or n_heads
    return KVLayout(layers, kv_heads, head_dim, dtype, windows, layer_heads=heads)


def _layer_heads(model: Any) -> tuple[tuple[int, int, int], ...]:
    """Each cached layer's (kv heads, key size, value size) as its attention module says (Gemma 4's differ between
    layers): its kv head count, and its `head_dim` or else its key and value projections' widths a head; () where a
    module does not say."""
    heads = [_module_heads(getattr(model.model.layers[i], "self_attn", None)) for i in cache_layers(model)]
    return () if any(h is None for h in heads) else tuple(heads)


def _out_features(linear: Any) -> int:
    """A linear's output width, under an adapter's wrapper (the engine's, or mlx-lm's LoRA of `--adapter-path`)."""
    while "weight" not in linear:
        linear = unadapted(linear) if "base" in linear else linear.linear
    # [out, in], or [splits, out, in / splits] where an earlier engine split it over K (`quantized_rows.split_k`)
    return int(linear.weight.shape[-2])


def _module_heads(attention: Any) -> tuple[int, int, int] | None:
    kv_heads = getattr(attention, "n_kv_heads", None) or getattr(attention, "num_kv_heads", None)
    if not kv_heads:
        return None
    width = {name: _out_features(attention[name]) // kv_heads for name in ("k_proj", "v_proj") if name in attention}
    key = getattr(attention, "head_dim", None) or width.get("k_proj")
    if key is None:
        return None
    return int(kv_heads), int(key), int(width.get("v_proj", key))


def quantized_kv_layout(model: Any, layout: KVLayout, config: EngineConfig) -> KVLayout:
    """The layout with `--kv-bits` applied, or InvalidRequest where the model's attention cannot read quantized KV
    (mlx-lm's quantized attention has no sinks or soft-capped scores) or its heads do not split into groups."""
    if config.kv_bits is None:
        return layout
    if layout.any_values_differ:
        raise InvalidRequest("--kv-bits: not with multi-head latent attention (mlx-lm quantizes no latent cache; "
                             "expanded heads keep keys and values of two sizes)", param="kv_bits")  # fmt: skip
    from mlx_serve.softcap_attention import SOFTCAPPED_MODULES

    modules = list(model.named_modules())
    if any(hasattr(m, "sinks") for _, m in modules) or any(type(m).__module__ in SOFTCAPPED_MODULES for _, m in modules):
        raise InvalidRequest("--kv-bits: this model's attention (sinks or soft-capped scores) cannot read quantized KV",
                             param="kv_bits")  # fmt: skip
    if getattr(model.args, "num_kv_shared_layers", 0):
        raise InvalidRequest("--kv-bits: not with layers that read another layer's K/V (Gemma 4): mlx-lm's quantized "
                             "caches cannot serve them, so there is no reference to hold the tokens to", param="kv_bits")
    if any(size % config.kv_group_size for size in layout.key_sizes):
        sizes = " and ".join(str(size) for size in sorted(layout.key_sizes))
        raise InvalidRequest(f"--kv-group-size {config.kv_group_size} does not divide the head size {sizes}",
                             param="kv_group_size")  # fmt: skip
    return replace(layout, bits=config.kv_bits, group_size=config.kv_group_size)


def load_draft(spec: str, vocab_size: int) -> Any:
    """The draft model (a local directory or a hub id in the cache), read in and checked against the served one."""
    from mlx_serve.draft_model import check_draft_model
    from mlx_serve.model_source import check_supported, resolve_model

    path = resolve_model(spec)
    check_supported(read_config(path))
    draft = text_model(_load(path, None)[0])
    _materialize(draft, show_progress=False, label="draft")
    mx.eval(module_buffers(draft))  # made on this thread: evaluated here, not on the engine's
    check_draft_model(draft, vocab_size, path)
    return draft


def kept_bytes(config: EngineConfig, loaded: LoadedModel) -> int:
    """What the budget keeps besides the weights and the KV pool: the adapters' share and the draft model's."""
    live, snapshots = state_slots(config, loaded)
    return int(config.adapter_memory_gb * GIB) + draft_bytes(config, loaded) + (live + snapshots) * loaded.state_bytes


def state_slots(config: EngineConfig, loaded: LoadedModel) -> tuple[int, int]:
    """Recurrent state slots: one per running request, and the snapshots kept for prefix hits (`--state-snapshots`;
    none without the prefix cache)."""
    if not loaded.state_bytes:
        return 0, 0
    snapshots = config.max_running if config.state_snapshots is None else config.state_snapshots
    if snapshots < 0:
        raise InvalidRequest(f"state_snapshots must be >= 0, not {snapshots}", param="state_snapshots")
    return config.max_running, snapshots if config.enable_prefix_cache else 0


def draft_bytes(config: EngineConfig, loaded: LoadedModel) -> int:
    """The draft model's weights and the most its caches may hold."""
    if loaded.draft is None or not config.draft_model:
        return 0
    from mlx_serve.model_source import weight_bytes

    return weight_bytes(loaded.draft) + config.draft_kv_tokens * loaded.draft_bytes_per_token


def chat_template_text(spec: str | None) -> str | None:
    """`--chat-template`: a file's contents, or the template itself; checked to render a conversation."""
    if spec is None:
        return None
    file = Path(spec).expanduser()
    try:
        text = file.read_text() if "{" not in spec and file.is_file() else spec
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"chat template {file}: {exc}", param="chat_template") from None
    if "{" not in text:
        raise InvalidRequest(f"chat template {spec!r} is neither a file nor a Jinja template", param="chat_template")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequest(f"chat template: line {exc.lineno}: {exc.message}", param="chat_template") from None
    return text


def _load(path: Path, adapter_path: str | None, chat_template: str | None = None) -> tuple[Any, Any]:
    """mlx-lm's model and tokenizer, with `adapter_path`'s fine-tune applied as mlx-lm applies it and
    `chat_template` in place of the checkpoint's."""
    import mlx_lm

    kwargs: dict[str, Any] = {"lazy": True}
    if chat_template is not None:
        kwargs["tokenizer_config"] = {"chat_template": chat_template}
    if adapter_path is None:
        return mlx_lm.load(str(path), **kwargs)
    adapter = Path(adapter_path).expanduser()
    if not (adapter / "adapter_config.json").is_file() or not (adapter / "adapters.safetensors").is_file():
        raise ModelNotFound(f"adapter path {adapter}: no adapter_config.json and adapters.safetensors there",
                            param="adapter_path")  # fmt: skip
    try:
        return mlx_lm.load(str(path), adapter_path=str(adapter), **kwargs)
    except (ValueError, KeyError) as exc:  # mlx-lm's word for a mismatched or malformed adapter
        raise InvalidRequest(f"adapter path {adapter}: {exc}", param="adapter_path") from None


def text_model(model: Any) -> Any:
    """A multimodal wrapper's language model (Gemma 3, Mistral 3: the checkpoint's text half, which the wrapper's
    forward only passes through); any other model as it is."""
    from mlx_serve import gemma3n, gpt_neox

    if gemma3n.is_gemma3n(getattr(getattr(model, "model", None), "language_model", None)):
        return gemma3n.text_model(model)
    if gpt_neox.is_gpt_neox(model):
        return gpt_neox.text_model(model)
    inner = getattr(model, "language_model", None)
    if inner is not None and hasattr(getattr(inner, "model", None), "layers"):
        if not hasattr(inner, "make_cache") and hasattr(model, "make_cache"):  # Llama 4: the wrapper says the caches
            object.__setattr__(inner, "make_cache", model.make_cache)
        return inner
    # the inner model and its layers under the names the engine reads, where a family names them otherwise (Nemotron-H:
    # `backbone`; GPT-2, nanochat, EXAONE 3: `transformer` and `h`): aliases, not children (parameters listed once)
    inner_name = next((name for name in ("backbone", "transformer") if name in model), None)
    if inner_name is not None and "model" not in model:
        object.__setattr__(model, "model", model[inner_name])
    inner = getattr(model, "model", None)
    if isinstance(inner, dict) and "h" in inner and "layers" not in inner:
        object.__setattr__(inner, "layers", inner["h"])
    return model


def module_buffers(model: Any) -> list[mx.array]:
    """Arrays the model's modules hold in private attributes (not parameters, so not loaded or evaluated)."""
    return [value for _, module in model.named_modules() for key, value in module.items()
            if key.startswith("_") and isinstance(value, mx.array)]  # fmt: skip


def activation_dtype(model: Any) -> mx.Dtype:
    """The dtype hidden states (and so K/V) take: the final norm's weights (floating even when quantized; under one
    of these names; some families have no per-layer input norm), or where it has no weights (nanochat) the
    embedding's (its scales, when quantized)."""
    inner = model.model
    name = next((name for name in ("norm", "embedding_norm", "final_layernorm", "norm_f", "ln_f") if name in inner),
                None)  # fmt: skip
    if name is not None:
        return inner[name].weight.dtype
    embedding = next(m for _, m in inner.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)))
    return embedding.scales.dtype if isinstance(embedding, nn.QuantizedEmbedding) else embedding.weight.dtype


def _materialize(model: Any, show_progress: bool, label: str) -> None:
    """Read the (lazily loaded) weights in, layer by layer, so a progress bar can follow the load."""
    from tqdm import tqdm

    layers = list(model.model.layers)
    with tqdm(total=len(layers) + 1, desc=label, unit="layer", disable=not show_progress, leave=False) as bar:
        for layer in layers:
            mx.eval(layer.parameters())
            bar.update()
        mx.eval(model.parameters())
        bar.update()


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def machine_memory_bytes() -> int:
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if key in info:
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True, slots=True)
class PoolSize:
    blocks: int  # the KV pool's blocks (every layer's, or with a window space the full-attention layers')
    window_blocks: int = 0  # the window space's (sliding-window layers'); 0: none


def kv_pool_blocks(config: EngineConfig, loaded: LoadedModel) -> int:
    """The pool's blocks (`kv_pool_size`)."""
    return kv_pool_size(config, loaded).blocks


def kv_pool_size(config: EngineConfig, loaded: LoadedModel) -> PoolSize:
    """Blocks that fit the memory budget after the weights, capped at what max_running requests can use; with a
    window space, what it leaves goes to the full-attention layers alone."""
    layout, size = loaded.layout, config.block_size
    block_bytes = layout.bytes_per_token() * size
    cap = math.ceil(config.max_running * loaded.context_length / size)
    if config.kv_blocks is not None:
        return PoolSize(config.kv_blocks, window_space_blocks(config, layout, config.kv_blocks))
    budget = config.memory_budget_gb * GIB if config.memory_budget_gb else 0.5 * machine_memory_bytes()
    # a tenth of what is left stays free for activations of the largest step; adapters loaded later get their share
    kv_bytes = (budget - loaded.weight_bytes - kept_bytes(config, loaded)) * 0.9
    # no layer keeps K/V (Mamba): blocks cost nothing, so every running request may fill its context
    blocks = min(int(kv_bytes // block_bytes), cap) if block_bytes else (cap if kv_bytes >= 0 else 0)
    window_blocks = window_space_blocks(config, layout, max(blocks, 0))
    if window_blocks:
        windowed = layout.windowed_bytes_per_token() * size
        blocks = min(int((kv_bytes - window_blocks * windowed) // (block_bytes - windowed)), cap)
    needed = math.ceil(min(loaded.context_length, 2048) / config.block_size)
    if blocks < needed:
        raise MlxServeError(
            f"memory budget {budget / GIB:.2f} GiB leaves room for {max(blocks, 0)} KV blocks after "
            f"{loaded.weight_bytes / GIB:.2f} GiB of weights{_also_kept(config, loaded)}; at least {needed} are needed "
            f"({block_bytes} bytes per block of {config.block_size} tokens). Raise --memory-budget-gb{_or_fewer(loaded)}."
        )
    return PoolSize(blocks, window_blocks)


def window_space_blocks(config: EngineConfig, layout: KVLayout, pool_blocks: int) -> int:
    """Blocks of the window space, where sliding-window layers keep only what their windows reach (0: none).

    Auto: room for every running request's window and a chunk, where that is less than the pool would give those
    layers without it (then no request mix fits fewer requests than before, and long ones fit many more: the full
    layers get the rest), and as much again for cached prefixes' windows where that still is."""
    widest, size = layout.widest_window, config.block_size
    if not widest or config.window_kv_tokens == 0:
        return 0
    tokens = config.window_kv_tokens
    if tokens is None:
        live = config.max_running * (widest + size) + config.row_ceiling
        tokens = next((t for t in (live + config.max_running * (widest + size), live) if t < pool_blocks * size), 0)
        if not tokens:
            return 0
    blocks = -(-tokens // size)
    least = -(-(widest - 1) // size) + 1
    if blocks < least:
        raise InvalidRequest(
            f"window_kv_tokens {tokens} cannot hold one request's window of {widest} tokens: it needs at least "
            f"{least * size} (blocks of {size})", param="window_kv_tokens",
        )
    return blocks


def _or_fewer(loaded: LoadedModel) -> str:
    """What else frees memory for the KV pool, where recurrent states take a share."""
    if not loaded.state_bytes:
        return ""
    return (f", or lower --max-running or --state-snapshots (each running request and each snapshot holds "
            f"{loaded.state_bytes / (1 << 20):.1f} MiB of recurrent state)")


def _also_kept(config: EngineConfig, loaded: LoadedModel) -> str:
    """What else the budget holds besides the weights, for the error that says it is too small."""
    kept = [f"{config.adapter_memory_gb:.2f} GiB kept for adapters"] if config.adapter_memory_gb else []
    if draft := draft_bytes(config, loaded):
        kept.append(f"{draft / GIB:.2f} GiB for the draft model and its caches")
    if loaded.state_bytes:
        live, snapshots = state_slots(config, loaded)
        kept.append(f"{(live + snapshots) * loaded.state_bytes / GIB:.2f} GiB for {live} requests' recurrent states "
                    f"and {snapshots} snapshots")
    return "".join(f" and {part}" for part in kept)
