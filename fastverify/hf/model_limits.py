"""What in a model's config bounds the sequences the draft-and-verify loop can decode exactly.

The loop keeps every committed token in a plain ``DynamicCache`` and hands the model one 4D mask for all of its
layers, a mask that lets each query see the whole committed prefix. Two kinds of config make a model compute
something else, and both only from some sequence length on:

- **Attention of limited reach.** A sliding-window layer sees the last ``sliding_window`` tokens, a chunked
  layer (Llama 4) its own ``attention_chunk_size`` chunk. transformers returns a ready 4D mask as-is, for every
  layer type, so the window would be ignored. While the whole sequence (prompt + new tokens) fits within the
  shortest reach, the window excludes nothing and full attention is exact (transformers' sliding mask keeps key
  k for query q iff q - k < window; the distance never exceeds length - 1). Read per layer type from
  ``layer_types`` where the config has one, else from the config's window attributes.

  Past that length the loop masks the window itself where it knows how the model takes its masks
  (``loop_window``: model types whose forward takes one 4D mask per layer type, transformers'
  ``causal_mask_mapping``, and those whose every layer is a ``sliding_window`` one); those windows set no limit.
- **Position-dependent RoPE.** ``dynamic`` (NTK) and ``longrope`` recompute their frequencies from the largest
  position in each forward once it passes ``original_max_position_embeddings``. A verify forward holds draft
  positions ahead of the committed ones, so past that length it would rotate the committed tokens differently
  from plain decoding. Below it both use the original frequencies.

``sequence_limit`` turns these into the longest sequence the loop may decode, or a reason it cannot run at all
(an attention type it does not know). The patched ``generate`` falls back, with a warning, beyond that.
``position_limit`` is the RoPE part alone, with the size of a table of position embeddings (GPT-2, OPT, ...): rows
that are not verified (a slot drafter's placeholder rows stand after the draft) must still keep the forward's span
below it, since the frequencies follow the largest position in the forward (transformers' dynamic RoPE also keeps
frequencies grown by an earlier, longer forward until a forward spans fewer positions than the bound) and a table
has no row past its end.
"""

__all__ = ["sequence_limit", "position_limit", "loop_window"]

# layer types of limited reach -> the config attribute holding the reach, in tokens
_LIMITED_LAYER_TYPES = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}
# window attributes read when a config has no layer_types
_WINDOW_ATTRS = ("sliding_window", "attention_chunk_size", "window_size")
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")
# model types whose sliding-window layers the loop masks itself, by how their forward takes masks: "layer_types",
# a dict with one 4D mask per layer type (transformers' causal_mask_mapping, taken as it is); "every_layer", one 4D
# mask for all layers (configs without layer_types whose every layer attends within ``sliding_window``)
_LOOP_WINDOWS = {"qwen2": "layer_types", "qwen3": "layer_types", "gemma2": "layer_types",
                 "gemma3_text": "layer_types", "cohere2": "layer_types", "ministral": "layer_types",
                 "olmo3": "layer_types", "smollm3": "layer_types", "gpt_oss": "layer_types",
                 "qwen2_moe": "layer_types", "exaone4": "layer_types", "afmoe": "layer_types",
                 "cohere2_moe": "layer_types", "cwm": "layer_types", "exaone_moe": "layer_types",
                 "flint": "layer_types", "granite_swa": "layer_types", "granitemoe_swa": "layer_types",
                 "kolibri1": "layer_types", "mimo_v2_flash": "layer_types", "modernbert-decoder": "layer_types",
                 "mistral": "every_layer",
                 "phi3": "every_layer", "mixtral": "every_layer", "starcoder2": "every_layer",
                 "qwen3_moe": "every_layer"}
# model types whose positions index a table of max_position_embeddings rows (learned or sinusoidal): a slot row past
# it would read outside the table
_POSITION_TABLES = ("gpt2", "opt", "gpt_bigcode", "gptj", "codegen", "biogpt", "ctrl", "gpt_neo")
# model types whose attention bias is ALiBi, built from a 2D attention mask (Falcon: where config.alibi is set)
_ALIBI_TYPES = ("bloom", "mpt")


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    try:
        return get() if callable(get) else config
    except TypeError:
        return config


def _positive_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def loop_window(config):
    """(window, layer types) where the loop masks the model's sliding-window layers itself: its forward takes a dict
    of masks keyed by the config's layer types (a tuple of them), or one mask for every layer (None); else None: no
    such layer, or a model type the loop does not know to take its masks either way (``_LOOP_WINDOWS``; its
    windows then limit the sequence)."""
    config = _text_config(config)
    how = _LOOP_WINDOWS.get(getattr(config, "model_type", None))
    window = getattr(config, "sliding_window", None)
    if how is None or not _positive_int(window):
        return None
    layer_types = getattr(config, "layer_types", None)
    if how == "layer_types":
        if not layer_types or "sliding_attention" not in layer_types:
            return None
        return window, tuple(sorted(set(layer_types)))
    if layer_types or getattr(config, "use_sliding_window", True) is False:
        return None
    return window, None


def _attention_limits(config, extra_attr):
    """[(reach in tokens, what it is)], or a str: the reason the loop cannot drive this attention."""
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention=True: the loop's masks are causal)"
    if getattr(config, "model_type", None) in _ALIBI_TYPES or getattr(config, "alibi", False) is True:
        return "ALiBi attention bias (built from a 2D attention mask; the loop hands the model a 4D one)"
    limits = []
    windowed = loop_window(config) is not None  # the loop masks sliding_window itself: no limit from it
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        for kind in sorted(set(layer_types)):
            if kind == "full_attention" or (kind == "sliding_attention" and windowed):
                continue
            attr = _LIMITED_LAYER_TYPES.get(kind)
            if attr is None:
                return f"layer type {kind!r} (the loop drives full, sliding-window and chunked attention only)"
            reach = getattr(config, attr, None)
            if not _positive_int(reach):
                return f"layer type {kind!r} with {attr}={reach!r}"
            limits.append((reach, f"{kind} layers ({attr}={reach})"))
    else:
        for attr in _WINDOW_ATTRS:
            reach = getattr(config, attr, None)
            if attr == "sliding_window" and (windowed or getattr(config, "use_sliding_window", True) is False):
                reach = None
            if reach is not None:
                if not _positive_int(reach):
                    return f"{attr}={reach!r}"
                limits.append((reach, f"{attr}={reach}"))
    if extra_attr:
        reach = getattr(config, extra_attr, None)
        if reach is not None:
            if not _positive_int(reach):
                return f"{extra_attr}={reach!r}"
            limits.append((reach, f"{extra_attr}={reach}"))
    return limits


def _rope_limits(config):
    """[(length from which the RoPE frequencies change, what it is)]."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return []
    # one dict, or one per layer type ({"full_attention": {...}, "sliding_attention": {...}})
    params = [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]
    limits = []
    for p in params:
        kind = p.get("rope_type", p.get("type"))
        if kind in _POSITION_DEPENDENT_ROPE:
            # dynamic grows from max_position_embeddings (its cached length), longrope switches at
            # original_max_position_embeddings: the shorter of the two present is a safe bound for both
            known = [v for v in (p.get("original_max_position_embeddings"),
                                 getattr(config, "max_position_embeddings", None)) if _positive_int(v)]
            if not known:
                return [(0, f"{kind} RoPE without original_max_position_embeddings")]
            limits.append((min(known), f"{kind} RoPE (its frequencies change past {min(known)} positions)"))
    return limits


def sequence_limit(config, extra_attr=None):
    """(longest sequence the loop decodes exactly, what sets it), (None, None) when nothing does, or
    (0, reason) when the loop cannot drive this model's attention at all.

    config: a transformers PretrainedConfig (a multimodal one is read through its text config); extra_attr:
    the name of one more window attribute (``ModelSpec.sliding_window_attr``)."""
    config = _text_config(config)
    limits = _attention_limits(config, extra_attr)
    if isinstance(limits, str):
        return 0, limits
    limits = limits + _rope_limits(config)
    if not limits:
        return None, None
    return min(limits)


def position_limit(config):
    """The number of positions a forward may span without changing the model's RoPE frequencies or leaving its
    table of position embeddings (every row of it at a position below this), or None where neither bounds it."""
    config = _text_config(config)
    limits = [limit for limit, _ in _rope_limits(config)]
    table = getattr(config, "max_position_embeddings", None)
    if getattr(config, "model_type", None) in _POSITION_TABLES and _positive_int(table):
        limits.append(table)
    return min(limits) if limits else None
