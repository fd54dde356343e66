"""``fastverify.patch(model)`` / ``fastverify.unpatch(model)``: draft-and-verify ``generate`` on a Hugging Face
causal LM, without copying any model file.

The patch rebinds ``generate`` on the instance (the class and other instances are untouched) and stores its
state in one instance attribute; ``unpatch`` restores the instance's ``__dict__`` entries exactly. The model
itself is driven through transformers' public extension points: a ready 4D attention mask (returned as-is by
``masking_utils``), explicit ``position_ids`` and a ``DynamicCache`` (see fastverify.hf.attention).

What the patched ``generate`` runs itself (everything else falls back to the original ``generate`` with one
warning naming the reason): greedy and sampling (do_sample, temperature, top_k, top_p, min_p in the verify op;
typical_p, epsilon_cutoff, eta_cutoff, top_h with generate's own warpers on the verify rows), batch >= 1 with
left padding and attention_mask, max_new_tokens / max_length, eos_token_id (int or list), pad_token_id,
streamer (batch 1), ``seed=`` (int, or one per request) for the sampling rules, num_return_sequences (sampling);
generate's own logits processors for stop strings, minimum lengths, repetition penalties, banned / suppressed
tokens, sequence biases, forced eos, exponential_decay_length_penalty and ``prefix_allowed_tokens_fn``; custom
``stopping_criteria`` and ``max_time`` (asked about the whole batch after every token, as generate asks them) and a
custom ``logits_processor`` at batch size 1, or any with ``row_processors=True`` (on every verify row, as assisted
decoding runs it); return_dict_in_generate with output_scores / output_logits (batch size 1, or eos_token_id None; no
cache in the output), renormalize_logits and remove_invalid_values; ``assistant_model`` (a DraftModelDrafter of it
drafts that call, num_assistant_tokens deep) and ``prompt_lookup_num_tokens`` (the n-gram drafter drafts it);
cache_implementation static / offloaded (the loop's own cache holds the same values).
"""

import dataclasses
import functools
import operator
import warnings

import torch

from fastverify.hf.attention import GQA_ATTENTION
from fastverify.hf.drafters import DraftModelDrafter, Drafter, NGramDrafter, check_ints
from fastverify.hf.layers import _capturing
from fastverify.hf.linear import config_of, model_lock, modules, pack_model
from fastverify.hf.loop import (SAMPLING_RULES, DecodeSettings, StopStrings, decode, embedding_rows, model_dtype,
                                 model_vocab_size)
from fastverify.hf.model_limits import loop_window, position_limit, sequence_limit
from fastverify.hf.probe import check_key, check_model, check_rows
from fastverify.hf.processors import transformers_at_least

__all__ = ["patch", "unpatch", "is_patched", "stats", "ModelSpec", "MODEL_REGISTRY", "register_model_type",
           "SUPPORTED_TRANSFORMERS", "TESTED_TRANSFORMERS"]

# [min, max): the releases this integration is tested on (scripts/test.sh runs the transformers tests on the oldest)
SUPPORTED_TRANSFORMERS = ("5.17", "6")
# the newest minor release the registry's types have been tested on (tests/test_hf_*.py); under a later one within
# SUPPORTED_TRANSFORMERS, whose modeling files may compute otherwise than the code the loop binds in for them
# expects, a registered type is checked as a type outside the registry is (fastverify.hf.probe.check_model)
TESTED_TRANSFORMERS = "5.25"
_STATE_ATTR = "_fastverify_patch"
RULES = ("greedy", "topk", "distance", "gad", "typical", "confidence", "speculative", "coupled")
RULE_PARAMS = ("k", "eps", "beta", "tau", "delta", "min_accept")
# the parameters each rule reads (min_accept: the deterministic rules only, Stern et al. Sec. 5.3)
_PARAMS_OF_RULE = {"greedy": ("min_accept",), "topk": ("k", "min_accept"), "distance": ("eps", "min_accept"),
                   "gad": ("beta", "tau", "min_accept"), "typical": ("eps", "delta", "min_accept"),
                   "confidence": ("beta", "min_accept"), "speculative": (), "coupled": ()}
# rules whose output differs from the target's own decoding (greedy argmax or exact sampling)
LOSSY_RULES = ("topk", "distance", "gad", "typical", "confidence")

# patch options that turn one of the loop's ways of computing off (each on by default; the DecodeSettings field)
_LOOP_SWITCHES = ("skinny_linear", "pack_weights", "lean_layers", "live_rows", "pace_batch")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """How the loop may drive a model type: attention implementations that honour a 4D additive mask, and
    optionally the name of one more config attribute that bounds how far back a layer attends (the usual
    ones, ``sliding_window``, ``attention_chunk_size``, ``window_size`` and ``layer_types``, are read from
    every config; see ``attention_reach``)."""

    model_type: str
    attn_implementations: tuple = ("eager", "sdpa")
    sliding_window_attr: str = None
    # the first transformers release whose own generate the loop reproduces for this type (None: every supported
    # one); before it the type counts as unregistered
    min_transformers: str = None

    def supported(self) -> bool:
        """Whether the installed transformers is at least ``min_transformers``."""
        return self.min_transformers is None or transformers_at_least(self.min_transformers)


MODEL_REGISTRY = {}


def register_model_type(spec: ModelSpec) -> None:
    """Declare a model type the loop may drive (decoder-only, standard DynamicCache, position_ids and 4D masks
    honoured by its attention)."""
    MODEL_REGISTRY[spec.model_type] = spec


# each tested on a tiny random model (tests/test_hf_model_types.py: greedy equal to generate, batch 1 and 3, eager and
# sdpa) and in the fuzz sweep (tests/hf_fuzz.py: the first eleven by default, every one with --archs all). gemma3:
# Gemma 3's image-text model (what AutoModelForCausalLM loads for the larger Gemma 3 checkpoints) on text prompts;
# a call with images passes model inputs the loop does not take (pixel_values), so it falls back
for _type in ("llama", "qwen2", "qwen3", "mistral", "gpt2", "gemma", "phi3", "olmo2", "granite",
              "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe", "phi", "stablelm", "starcoder2",
              "gpt_neox", "falcon", "opt", "gptj", "codegen", "gpt_bigcode", "cohere", "cohere2", "olmo", "olmo3",
              "olmoe", "glm", "glm4", "helium", "granitemoe", "nemotron", "persimmon", "exaone4", "arcee",
              "apertus", "seed_oss", "ministral", "smollm3", "gpt_oss", "ministral3", "glm4_moe", "hunyuan_v1_dense",
              "ernie4_5", "ernie4_5_moe", "internlm3", "vaultgemma", "phimoe", "jetmoe", "granitemoeshared", "bitnet",
              "diffllama", "gemma3", "deepseek_v2", "deepseek_v3", "minicpm3", "longcat_flash", "dots1",
              "dbrx", "glm4_moe_lite", "youtu", "sarvam_mla", "afmoe", "apertus1p5_text", "aria_text", "biogpt",
              "cohere2_moe", "ctrl", "cwm", "exaone", "exaone_moe", "flex_olmo", "flint",
              "gpt_neox_japanese", "granite_swa", "granitemoe_swa", "hunyuan_v1_moe", "hy_v3", "hyperclovax",
              "iquestcoder", "jais2", "kolibri1", "laguna", "llama4_text", "mellum", "mimo_v2_flash", "minimax_m2",
              "nanochat", "sarvam_moe", "solar_open", "xglm", "modernbert-decoder"):
    register_model_type(ModelSpec(_type))
# Doge before 5.18: its forward under its dynamic mask is not causal (a position's logits depend on later tokens)
register_model_type(ModelSpec("doge", min_transformers="5.18"))


def _later_than_tested(release: str) -> bool:
    """Whether transformers ``release`` is a later minor release than ``TESTED_TRANSFORMERS`` (its development
    versions included; a patch release of the tested one is not)."""
    from packaging.version import Version
    return Version(release).release[:2] > tuple(int(x) for x in TESTED_TRANSFORMERS.split("."))


@functools.cache
def _untested_transformers() -> bool:
    import transformers
    return _later_than_tested(transformers.__version__)


def _check_transformers_version():
    import transformers
    lo, hi = SUPPORTED_TRANSFORMERS
    if not transformers_at_least(lo) or transformers_at_least(hi):
        raise RuntimeError(f"fastverify.patch: transformers {transformers.__version__} is not supported; the "
                           f"integration is tested with transformers >= {lo}, < {hi}. Install a version in "
                           f"that range (pip install 'transformers>={lo},<{hi}').")


@dataclasses.dataclass
class _PatchState:
    spec: ModelSpec
    drafter: Drafter
    rule: str
    options: dict
    had_instance_generate: bool
    instance_generate: object
    last_stats: object = None
    warned_precision: bool = False
    # a type outside the registry (allow_unknown_model), a model running code from outside transformers, or any
    # model under a transformers later than TESTED_TRANSFORMERS: fastverify.hf.probe's verdicts, "" (passed) or the
    # reason it failed, per what the check ran under (``probe.check_key``: the model's dtype, device and attention
    # implementation, the call's computation options); one is made at the first call the loop runs under each
    unregistered: bool = False
    checks: dict = dataclasses.field(default_factory=dict)
    # fastverify.hf.probe.check_rows's verdicts for sampled calls, keyed as ``checks`` (``_sample_row_invariant``)
    row_checks: dict = dataclasses.field(default_factory=dict)


class PatchedGenerate:
    """``model.generate`` while the model is patched: a bound-method-like callable (``__self__``, ``__func__``).

    A plain bound method of a module-level function would pickle as a look-up of the function's name on the
    model, which fails on loading; this object pickles with the model (``pickle``, ``torch.save``,
    ``copy.deepcopy``), so a patched model loads patched."""

    __name__ = "generate"

    def __init__(self, model):
        self.__self__ = model

    @property
    def __func__(self):
        return _patched_generate

    @property
    def __doc__(self):
        return _patched_generate.__doc__

    def __call__(self, *args, **kwargs):
        return _patched_generate(self.__self__, *args, **kwargs)

    def __repr__(self):
        return f"<fastverify patched generate of {type(self.__self__).__name__} object>"


def _original_generate(model, state):
    """The generate that patch() replaced: the instance's own attribute, or the class's method bound to model."""
    if state.had_instance_generate:
        return state.instance_generate
    return type(model).generate.__get__(model, type(model))


def _check_rule_options(rule, options):
    """Check the rule and its parameters when patching (not at the first generate): a parameter the rule does not
    read, one it needs and lacks, a value out of range. The values are checked by verify itself, on a
    one-node batch, so patch and verify cannot disagree."""
    from fastverify.ops.verify import verify
    params = {k: options[k] for k in RULE_PARAMS if k in options}
    rules = (rule,) if rule is not None else ("greedy",)  # no rule: greedy, or coupled when sampling
    for name in params:
        if name not in _PARAMS_OF_RULE[rules[0]]:
            readers = [r for r, ps in _PARAMS_OF_RULE.items() if name in ps]
            raise ValueError(f"{name}: not a parameter of rule {rules[0]!r}" + (" (the default)" if rule is None
                             else "") + f"; it is read by rule(s) {readers}: pass rule=... as well")
    extra = {"seed": 0, "position": torch.zeros(1, dtype=torch.int64)} if rules[0] in SAMPLING_RULES else {}
    verify(torch.zeros(2, 2, dtype=torch.float32), torch.zeros(1, dtype=torch.int64),
           torch.tensor([0, 1], dtype=torch.int32), rule=rules[0], backend="torch", **params, **extra)


def _unwrapped(model):
    """The model that a ``torch.compile`` wrapper (``OptimizedModule``) wraps, else ``model`` itself: the wrapper's
    ``generate`` is its model's, so patching it patches that model (whose loop runs fastverify's kernels, not the
    compiled graph)."""
    if type(model).__name__ != "OptimizedModule" or not type(model).__module__.startswith("torch._dynamo"):
        return model
    inner = model.__dict__.get("_modules", {}).get("_orig_mod")
    return inner if inner is not None else model


def is_patched(model) -> bool:
    return _STATE_ATTR in getattr(_unwrapped(model), "__dict__", {})


def stats(model):
    """The LoopStats of the last patched ``generate`` call on ``model`` (None before the first / after a
    fallback)."""
    state = _unwrapped(model).__dict__.get(_STATE_ATTR)
    return None if state is None else state.last_stats


def patch(model, drafter: Drafter = None, rule: str = None, **options):
    """Make ``model.generate`` run fastverify's draft-and-verify loop. Returns the same model.

    drafter: a ``fastverify.hf.drafters.Drafter`` (default ``NGramDrafter()``).
    rule: a verify rule ("greedy", "topk", "distance", "gad", "typical", "confidence", "speculative",
        "coupled"); default: "greedy" when not sampling, "coupled" when sampling. The default rules, and
        "speculative", are exact: greedy output equals ``generate(do_sample=False)`` token for token, sampled
        output follows the model's own (warped) distribution. The lossy rules "topk", "distance", "gad",
        "typical" and "confidence", and ``min_accept`` > 0, accept tokens the model would not have chosen: they
        CHANGE the output (faster, approximately the model's), as in the papers that define them. Under
        "confidence", a drafter that knows its own confidence (LUD's slot drafter: ``confident_prefix``) also has
        the leading draft tokens it is sure of (probability >= beta, no repeat) accepted without the target's
        check, as Lexical Unit Decoding accepts its lookahead span, and every other token is the model's argmax
        (LUD's own decoding; fastverify.hf.slots). A lossy or
        greedy rule with ``generate(do_sample=True)`` samples with "coupled" instead, with a warning.
    options: the rule's parameters (k, eps, beta, tau, delta, min_accept), ``max_draft`` (most draft nodes per
        request and step, default 32), ``backend`` (verify / compact_cache backend, default "auto"),
        ``sync`` (synchronise CUDA around phases for exact stats), ``skinny_linear`` (default True: while the loop
        runs, the model's float32 CPU ``nn.Linear`` layers compute inputs of at most
        ``fastverify.hf.linear.MAX_ROWS`` (128) rows with ``fastverify.skinny_linear``, which streams the weight
        once; see fastverify.hf.linear; with it or lean_layers, a longer prompt runs in forwards of at most that
        many rows ahead of the first step, and a request drafts at most (128 - B) // B nodes, so that every forward
        runs the kernels, whose rows are row-invariant: drafts and batch-mates change no bit of a request's logits),
        ``pack_weights`` (default True: with skinny_linear, a layer whose float32 weight is exactly 4- or 8-bit
        block-quantised values, as a model dequantised from a GGUF file's Q4_0 / Q4_1 / Q8_0 tensors, streams a
        packed copy of it: the same result bit for bit, a fifth of the bytes; packed here, once per weight, and
        kept), ``lean_layers`` (default True: Llama / Mistral / Qwen2 / Qwen3 decoder layers run the loop's forward
        of them, the same ops in fewer calls, their q / k / v and gate / up projections stacked; see
        fastverify.hf.layers), ``live_rows`` (default True: in a batch on the CPU, the rows that only pad a request
        to the largest tree's skip the output projection and, in those layers, the norms, projections and MLP;
        the other rows' results unchanged bit for bit), ``pace_batch`` (default True: in a batch on the CPU under
        the greedy or coupled rule, a request that would end, at one token a step, well before the request expected
        to end last gets no draft that step; the batch runs until its last request ends, so those drafts would cost
        rows and save no step), ``row_processors`` (default False: a custom ``logits_processor`` runs at batch size
        1 only, called with one row at a time; True declares that each of its processors computes each row from
        that row alone, without the row's batch index or state kept across calls, and the loop then runs it at any
        batch size), ``row_hooks`` (default False: a call on a model with forward hooks or pre-hooks, someone
        else's, on its modules falls back to the original generate, since a hook sees the loop's forwards, a
        request's draft rows after its committed ones; True declares that each hook computes each row from that
        row alone, a row-wise edit or a recorder, and the loop then runs with them),
        ``allow_unknown_model`` (a model type outside the registry: before the first call the loop runs, it decodes
        a small probe batch and compares it with the original generate, fastverify.hf.probe, again after the model
        is cast or moved or a call changes how the loop computes; a type that fails falls back to the original
        generate, with the reason, on every such call), ``invariant_sampling`` (default True: seeded sampling draws
        what undrafted decoding draws, checked as below; False: sampled calls draft on any model, the tokens'
        distribution the same, a draw possibly another at a float near-tie where the forward is not row-invariant).
    Patching a patched model replaces its drafter / rule / options. A patched model pickles (``torch.save`` of
    the whole model) and loads patched. A ``torch.compile`` wrapper of a model: the model it wraps is patched
    (the loop runs its own kernels, not the compiled graph).

    A model of a registered type that runs code from outside transformers and torch.nn (module classes: a user's
    own attention, an adapter library's layers, a checkpoint's remote code, torch.ao's quantized linears; a forward
    bound over a transformers class's or instance's own) is checked as an unknown type is, before the first call
    the loop runs with each set of such code. So is every model under a transformers release later than
    ``TESTED_TRANSFORMERS`` (the registry vouches for the modeling code of the releases it was tested on).

    Seeded sampling (the coupled rule) draws what undrafted decoding draws, draw for draw, where the loop's
    forwards are row-invariant; the first sampled call under each dtype, device, attention implementation and
    options checks that on a probe batch (fastverify.hf.probe.check_rows), and where it does not hold sampled calls
    decode without drafts, with a warning.

    What the patched generate does not run falls back to the original generate with one warning naming the
    reason; that includes sequences longer than a chunked attention layer's reach, than a sliding-window one's
    where the loop does not mask the window itself (``model_limits.loop_window``: it does for Qwen2, Qwen3,
    Gemma 2 / 3, Mistral, Phi-3 and others) or than where a dynamic / longrope RoPE changes its frequencies (see
    fastverify.hf.model_limits). The model's logits NaN, +inf or all -inf on a row the output depends on raise a
    ValueError naming the request and the step (plain greedy ``generate`` would emit an arbitrary token there),
    after that step has run again without drafts where it had some (a draft token's non-finite activations reach
    the other rows' attention as 0 x NaN); a greedy row that the processors leave all -inf gives token 0, as
    ``generate``'s argmax does. The loop's forwards run other kernels than ``generate``'s and round otherwise: in
    float32 by float32 rounding (greedy output can differ only at a near-tie of two logits within it), in float16 /
    bfloat16, where a verify forward's rows are not row-invariant either, enough that near-ties may resolve the
    other way (as in transformers' assisted decoding); a half-precision model's first greedy / coupled generate
    warns once. One patched call at a time per model, and per drafter (models patched with one drafter): a second
    thread's call waits for the first (``fastverify.hf.linear.model_lock``).
    """
    _check_transformers_version()
    inner = _unwrapped(model)
    if inner is not model:  # a torch.compile wrapper: its model, and the wrapper returned
        patch(inner, drafter, rule, **options)
        return model
    switches = (*_LOOP_SWITCHES, "row_processors", "row_hooks", "invariant_sampling", "sync", "allow_unknown_model")
    extra = ("max_draft", "backend", *switches)
    unknown = set(options) - set(RULE_PARAMS) - set(extra)
    if unknown:
        raise TypeError(f"fastverify.patch: unknown option(s) {sorted(unknown)}; expected rule parameters "
                        f"{RULE_PARAMS} or {', '.join(extra)}")
    for name in switches:
        if options.get(name, True) not in (True, False):
            raise TypeError(f"{name}: expected a bool, got {options[name]!r}")
    draft = options.get("max_draft", 32)  # the most draft nodes per request and step
    check_ints(max_draft=draft)
    if draft < 0:
        raise ValueError(f"max_draft: expected >= 0 (0: no drafts), got {draft}")
    if rule is not None and rule not in RULES:
        raise ValueError(f"rule: expected one of {RULES} or None, got {rule!r}")
    _check_rule_options(rule, options)
    if drafter is not None and not (hasattr(drafter, "propose") and hasattr(drafter, "update")):
        raise TypeError(f"drafter: expected a fastverify Drafter (propose / update), got {type(drafter).__name__}")
    if not hasattr(model, "generate") or not hasattr(model, "config"):
        raise TypeError(f"model: expected a transformers causal LM, got {type(model).__name__}")
    mismatch = drafter.vocabulary_mismatch(model) if isinstance(drafter, DraftModelDrafter) else None
    if mismatch is not None:
        raise ValueError(f"drafter: {mismatch}")
    model_type = getattr(model.config, "model_type", None)
    spec = MODEL_REGISTRY.get(model_type)
    registered = spec is not None and spec.supported()
    if spec is not None and not registered:
        import transformers
        if not options.get("allow_unknown_model", False):
            raise ValueError(f"fastverify.patch: model type {model_type!r} is registered for transformers >= "
                             f"{spec.min_transformers} (the loop does not reproduce transformers "
                             f"{transformers.__version__}'s own generate for it); upgrade transformers, or pass "
                             f"allow_unknown_model=True to have the loop checked against the model first")
        spec = None
    if spec is None:
        if not options.get("allow_unknown_model", False):
            raise ValueError(f"fastverify.patch: model type {model_type!r} is not in the registry "
                             f"({sorted(MODEL_REGISTRY)}); register it with fastverify.hf.register_model_type "
                             f"after checking that its attention honours a 4D mask and position_ids for every "
                             f"layer (sliding-window, chunked or local layers: the window must come from the "
                             f"config, see fastverify.hf.model_limits), that it uses a standard DynamicCache, "
                             f"or pass allow_unknown_model=True")
        spec = ModelSpec(model_type)
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("fastverify.patch: encoder-decoder models are not supported (decoder-only causal LMs)")
    if is_patched(model):
        unpatch(model)
    had = "generate" in model.__dict__
    state = _PatchState(spec=spec, drafter=drafter if drafter is not None else NGramDrafter(), rule=rule,
                        options=dict(options), had_instance_generate=had,
                        instance_generate=model.__dict__.get("generate"),
                        unregistered=not registered)
    model.__dict__[_STATE_ATTR] = state
    model.__dict__["generate"] = PatchedGenerate(model)
    if options.get("skinny_linear", True) and options.get("pack_weights", True):
        pack_model(model)  # here rather than inside the first generate
    return model


def unpatch(model):
    """Undo ``patch``: the instance's ``generate`` is again exactly what it was (the class's method, or the
    instance attribute that was there before). Returns the model; a no-op on an unpatched model."""
    inner = _unwrapped(model)
    if inner is not model:
        unpatch(inner)
        return model
    state = model.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return model
    if state.had_instance_generate:
        model.__dict__["generate"] = state.instance_generate
    else:
        model.__dict__.pop("generate", None)
    return model


# generation-config fields the loop honours; any other field set to a non-default value means fallback.
_HANDLED = {"max_length", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p", "stop_strings",
            "min_length", "min_new_tokens", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids",
            "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "forced_eos_token_id", "eos_token_id",
            "pad_token_id", "bos_token_id", "max_time", "num_return_sequences", "return_dict_in_generate",
            "exponential_decay_length_penalty", "output_scores", "output_logits", "renormalize_logits",
            "remove_invalid_values", "prompt_lookup_num_tokens", "typical_p", "epsilon_cutoff", "eta_cutoff",
            "top_h", "decoder_start_token_id", "use_cache", "transformers_version", "_from_model_config",
            "_commit_hash", "_original_object_hash", "generation_kwargs"}
# fields whose default values are neutral (the field is harmless when it has this value)
_NEUTRAL = {"num_beams": 1, "encoder_repetition_penalty": 1.0, "length_penalty": 1.0,
            "encoder_no_repeat_ngram_size": 0, "diversity_penalty": 0.0, "num_beam_groups": 1,
            "output_attentions": False, "output_hidden_states": False, "early_stopping": False, "low_memory": False,
            "guidance_scale": 1.0, "is_assistant": False, "disable_compile": False, "use_mtp": False}
# fields generate acts on whenever they are not None: 0 and empty values ask for something too (forced_bos_token_id=0
# forces token 0 after a one-token prompt; an empty constraint list or dola_layers="" selects generate's mode)
_SET_UNLESS_NONE = {"forced_bos_token_id", "assistant_early_exit", "constraints", "force_words_ids", "dola_layers"}
# fields that only configure features the loop never uses (assistant models, compile, caches' sizes)
_IRRELEVANT = {"num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
               "assistant_lookbehind", "target_lookbehind", "compile_config", "max_matching_ngram_size",
               "cache_config", "max_cache_len", "continuous_batching_config", "prefill_chunk_size",
               "assistant_ensemble_weight", "speculation_type"}


def _is_set(value) -> bool:
    """Whether a generate argument / config field asks for something: not None, False, 0 or empty. Tensors
    are never compared by value (``tensor in (None, False)`` raises for more than one element)."""
    if value is None or value is False:
        return False
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value != 0
    if isinstance(value, (str, tuple, list, dict, set)):
        return len(value) > 0
    return True


# model inputs generate takes as None (others it passes to the forward, where None may raise: logits_to_keep)
_NONE_MODEL_KWARGS = ("position_ids", "token_type_ids", "cache", "cache_position")

# cache implementations that hold the same keys and values as the loop's own cache (a DynamicCache): where they
# live differs, not what attention reads (quantized caches change the values; sliding-window ones what is kept)
_SAME_CACHE = ("dynamic", "static", "offloaded", "offloaded_static")


def _unsupported_config(gc) -> list:
    reasons = []
    for name, value in vars(gc).items():
        if name in _HANDLED or name in _IRRELEVANT or value is None:
            continue
        if name == "cache_implementation":
            if value not in _SAME_CACHE:
                reasons.append(f"{name}={value!r}")
            continue
        if name in _NEUTRAL:
            if isinstance(value, torch.Tensor) or value != _NEUTRAL[name]:
                reasons.append(f"{name}={value!r}")
        elif (name in _SET_UNLESS_NONE or _is_set(value)) and not name.startswith("_"):
            reasons.append(f"{name}={value!r}")
    if not gc.use_cache:  # (None too: generate then prepares no cache, and its forwards make one of their own)
        reasons.append(f"use_cache={gc.use_cache!r}")
    for name in ("num_beams", "num_return_sequences"):  # None where the call sets it so: generate's TypeError
        if getattr(gc, name, 1) is None:
            reasons.append(f"{name}=None")
    return reasons


def _generation_config(model, generation_config, kwargs):
    """Merge the model's generation config, transformers' defaults and kwargs as ``generate`` does."""
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is not None:
        try:
            return prepare(generation_config, **kwargs)
        except TypeError:
            pass
    import copy
    gc = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    return gc, gc.update(**kwargs)


def _as_list(x):
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [int(t) for t in x.reshape(-1).tolist()]
    if isinstance(x, (list, tuple)):
        return [int(t) for t in x]
    return [int(x)]


def _min_tokens(gc, L: int) -> int:
    """The tokens a request generates before eos may end it: min_new_tokens, which generate lets take precedence
    (it sets min_length = L + min_new_tokens), else min_length - L (L: the padded prompt's length)."""
    if gc.min_new_tokens is not None:
        return int(gc.min_new_tokens)
    return int(gc.min_length or 0) - L


def _refused_as_generate_reads(gc, assistant, L: int):
    """Options generate itself refuses as it reads them, or None: its generation mode (a top_k or penalty_alpha
    it cannot compare), its special tokens as tensors (a token id that is no number), the prompt lookup's sizes
    (its candidate generator's check), a bool top_k when sampling, a prefill chunk size that is no positive int,
    the minimum lengths its processors' constructors refuse (a float min_new_tokens; built where generate
    builds them: an eos criterion, a length > 0, min_length L + min_new_tokens where that is set), a repetition
    penalty or n-gram size its processors refuse, an empty eos list without a pad, and counts of returned
    sequences it refuses (greedy: one)."""
    try:
        gc.get_generation_mode(assistant)
    except (TypeError, ValueError) as e:
        return f"the generation mode of these options: {str(e)[:80]}"
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        value = getattr(gc, name, None)
        if value is not None and not isinstance(value, torch.Tensor):
            try:
                torch.tensor(value, dtype=torch.int64)
            except (TypeError, ValueError, RuntimeError):
                return f"{name}={value!r}"
    if gc.prompt_lookup_num_tokens is not None and assistant is None:
        size = 2 if gc.max_matching_ngram_size is None else gc.max_matching_ngram_size
        if not all(isinstance(n, int) and n > 0 for n in (gc.prompt_lookup_num_tokens, size)):
            return f"prompt_lookup_num_tokens={gc.prompt_lookup_num_tokens!r}, max_matching_ngram_size={size!r}"
    if gc.do_sample and type(gc.top_k) is bool:  # (torch.topk's TypeError when generate's warper runs)
        return f"top_k={gc.top_k!r}"
    chunk = getattr(gc, "prefill_chunk_size", None)
    if chunk is not None and not (type(chunk) is int and chunk > 0):
        return f"prefill_chunk_size={chunk!r}"
    if gc.eos_token_id is not None:
        from transformers.generation.logits_process import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor
        eos = torch.tensor(_as_list(gc.eos_token_id), dtype=torch.int64)
        min_length = gc.min_length if gc.min_new_tokens is None else gc.min_new_tokens + L
        try:
            if min_length is not None and min_length > 0:
                MinLengthLogitsProcessor(min_length, eos)
            if gc.min_new_tokens is not None and gc.min_new_tokens > 0:
                MinNewTokensLengthLogitsProcessor(L, gc.min_new_tokens, eos)
        except (ValueError, TypeError) as e:
            return f"min_length={gc.min_length!r}, min_new_tokens={gc.min_new_tokens!r}: {str(e)[:80]}"
    penalty = gc.repetition_penalty
    if penalty is not None and penalty != 1.0 and not (isinstance(penalty, float) and penalty > 0):
        return f"repetition_penalty={penalty!r}"
    if type(_ngram_size(gc)) is not int:
        return f"no_repeat_ngram_size={gc.no_repeat_ngram_size!r}"
    if gc.eos_token_id is not None and not _as_list(gc.eos_token_id) and gc.pad_token_id is None:
        return "eos_token_id=[] without a pad_token_id"  # (generate takes eos[0] as its pad)
    copies = max(1, gc.num_return_sequences)
    if type(copies) is not int:
        return f"num_return_sequences={gc.num_return_sequences!r}"
    if copies > 1 and not gc.do_sample:
        return f"num_return_sequences={copies} without sampling"
    return None


def _ngram_size(gc):
    """no_repeat_ngram_size as generate runs it: none (0) for a size <= 0."""
    size = gc.no_repeat_ngram_size
    return size if size is not None and size > 0 else 0


def _token_processors(gc, eos, vocab_size):
    """(DecodeSettings fields, None) for bad_words_ids / suppress_tokens / begin_suppress_tokens / sequence_bias /
    forced_eos_token_id, as generate's processors take them (a bad word that is a single eos token dropped), or
    (None, reason) for values generate refuses."""
    out = {}
    words = gc.bad_words_ids
    if words is not None:
        if not (isinstance(words, list) and words and all(isinstance(w, list) and w for w in words)
                and all(isinstance(t, int) and 0 <= t < vocab_size for w in words for t in w)):
            return None, f"bad_words_ids={words!r}"
        out["bad_words"] = tuple((tuple(w[:-1]), w[-1]) for w in words if not (len(w) == 1 and w[0] in eos))
    for name, field_name in (("suppress_tokens", "suppress"), ("begin_suppress_tokens", "begin_suppress")):
        tokens = getattr(gc, name, None)
        if tokens is not None:
            if not all(isinstance(t, int) for t in tokens):
                return None, f"{name}={tokens!r}"
            out[field_name] = frozenset(tokens)
    if gc.sequence_bias is not None:
        from transformers.generation.logits_process import SequenceBiasLogitsProcessor
        try:  # its own checks and its conversion to {tuple of tokens: bias}
            biases = SequenceBiasLogitsProcessor(gc.sequence_bias).sequence_bias
        except (ValueError, TypeError):
            return None, f"sequence_bias={gc.sequence_bias!r}"
        if any(t >= vocab_size for seq in biases for t in seq):
            return None, f"sequence_bias={gc.sequence_bias!r}"
        # generate's order of summation: the single tokens, then the longer sequences grouped by their length in the
        # order the lengths first come
        order = sorted(biases, key=lambda seq: (len(seq) > 1, [len(q) for q in biases].index(len(seq))))
        out["sequence_bias"] = tuple((tuple(seq[:-1]), seq[-1], torch.tensor(float(biases[seq]), dtype=torch.float32)
                                      .item()) for seq in order)  # the biases as float32 values, as generate's
    if gc.forced_eos_token_id is not None:
        forced = gc.forced_eos_token_id
        forced = forced.tolist() if isinstance(forced, torch.Tensor) else forced
        forced = forced if isinstance(forced, (list, tuple)) else [forced]
        if not (forced and all(type(t) is int and 0 <= t < vocab_size for t in forced)):
            return None, f"forced_eos_token_id={gc.forced_eos_token_id!r}"
        out["forced_eos"] = tuple(forced)
    return out, None


# generate's own processors / stopping criteria for the generation-config fields the loop runs: a custom one of
# the same type replaces generate's in its list (``_merge_criteria_processor_list``), which the loop does not mirror;
# each made on generate's own condition (an eos_token_id that is not None, an empty list too, makes those of eos)
def _own_processor_types(gc, prefix_allowed) -> set:
    from transformers.generation import logits_process as lp
    eos = gc.eos_token_id is not None
    fields = ((lp.PrefixConstrainedLogitsProcessor, prefix_allowed is not None),
              (lp.MinLengthLogitsProcessor, gc.min_length is not None and gc.min_length > 0 and eos),
              (lp.MinNewTokensLengthLogitsProcessor, gc.min_new_tokens is not None and gc.min_new_tokens > 0 and eos),
              (lp.RepetitionPenaltyLogitsProcessor, gc.repetition_penalty not in (None, 1.0)),
              (lp.NoRepeatNGramLogitsProcessor, gc.no_repeat_ngram_size is not None and gc.no_repeat_ngram_size > 0),
              (lp.NoBadWordsLogitsProcessor, gc.bad_words_ids is not None),
              (lp.SequenceBiasLogitsProcessor, gc.sequence_bias is not None),
              (lp.ForcedEOSTokenLogitsProcessor, gc.forced_eos_token_id is not None),
              (lp.InfNanRemoveLogitsProcessor, gc.remove_invalid_values is True),
              (lp.ExponentialDecayLengthPenalty, gc.exponential_decay_length_penalty is not None),
              (lp.SuppressTokensLogitsProcessor, gc.suppress_tokens is not None),
              (lp.SuppressTokensAtBeginLogitsProcessor, gc.begin_suppress_tokens is not None))
    return {cls for cls, made in fields if made}


def _own_criteria_types(gc) -> set:
    from transformers.generation import stopping_criteria as sc
    fields = ((sc.MaxLengthCriteria, True), (sc.MaxTimeCriteria, gc.max_time is not None),
              (sc.StopStringCriteria, gc.stop_strings is not None), (sc.EosTokenCriteria, gc.eos_token_id is not None))
    return {cls for cls, made in fields if made}


def _call_processors(model, state, call, gc, eos, inputs, copies: int):
    """(DecodeSettings fields, None) for generate's processors and criteria of the call, as generate builds them
    (``_token_processors``, the length penalty, ``prefix_allowed_tokens_fn``, the custom lists, stop strings,
    repetition penalties), or (None, reason). ``copies``: the sequences returned per prompt."""
    out, reason = _token_processors(gc, eos, model_vocab_size(model))
    if reason:
        return None, reason + " (generate's own error follows)"
    decay = gc.exponential_decay_length_penalty
    if decay is not None:  # generate's own processor, built as generate builds it (the padded prompt's length)
        from transformers.generation.logits_process import ExponentialDecayLengthPenalty
        if not (isinstance(decay, (tuple, list)) and len(decay) == 2 and isinstance(decay[0], int)
                and isinstance(decay[1], (int, float)) and eos):
            return None, f"exponential_decay_length_penalty={decay!r} (generate's own error follows)"
        out["length_decay"] = ExponentialDecayLengthPenalty(tuple(decay), eos, inputs.shape[1])
    if call.prefix_allowed is not None:
        if copies > 1:  # the processor's beams: its all -inf fallback reads a prompt's copies together
            return None, "prefix_allowed_tokens_fn with num_return_sequences > 1"
        out["prefix_allowed"] = call.prefix_allowed
    rows = 1 if state.options.get("row_processors", False) else inputs.shape[0] * copies  # as one row at a time
    custom, reason = _custom_lists(gc, call.processors, call.criteria, rows, call.prefix_allowed)
    if reason:
        return None, reason
    out.update(custom)
    if gc.stop_strings is not None:  # as generate: "" too (it ends a row at its first token), and [] (an error)
        if call.tokenizer is None:  # generate's own error follows
            return None, "stop_strings without a tokenizer"
        try:
            out["stop"] = StopStrings(gc.stop_strings, call.tokenizer)
        except ValueError as e:
            return None, f"stop_strings={gc.stop_strings!r}: {str(e)[:80]} (generate's own error follows)"
    penalty = gc.repetition_penalty
    out["repetition_penalty"] = 1.0 if penalty is None else float(penalty)
    out["no_repeat_ngram_size"] = _ngram_size(gc)
    return out, None


def _call_drafter(model, state, call, gc):
    """(drafter, None) for a call whose arguments name one (assisted decoding's ``assistant_model``: a
    DraftModelDrafter of it, num_assistant_tokens deep; ``prompt_lookup_num_tokens``: the n-gram drafter), (None,
    None) for the patch's own, or (None, reason)."""
    if call.assistant is not None:
        if not (hasattr(call.assistant, "config") and callable(call.assistant)):
            return None, f"assistant_model={type(call.assistant).__name__} (generate's own error follows)"
        drafter = DraftModelDrafter(call.assistant, k=int(gc.num_assistant_tokens or DraftModelDrafter.K))
        mismatch = drafter.vocabulary_mismatch(model)
        if mismatch is not None:
            return None, f"assistant_model: {mismatch} (generate's own error follows)"
        return drafter, None
    if gc.prompt_lookup_num_tokens is not None:
        return (state.drafter if isinstance(state.drafter, NGramDrafter) else NGramDrafter()), None
    return None, None


def _custom_lists(gc, processors, criteria, batch_size, prefix_allowed=None):
    """(DecodeSettings fields, None) for generate's ``logits_processor`` / ``stopping_criteria`` arguments and
    ``max_time``, or (None, reason). The processors run on every verify row as a batch of one (the row's sequence,
    its logits), as transformers' assisted decoding runs them on each candidate position: only at batch size 1,
    where that is the shape generate calls them with. The criteria (and max_time's MaxTimeCriteria) are asked
    what generate asks, in its order, on its whole batch: after every token once every running request has it."""
    from transformers.generation.logits_process import LogitsProcessorList
    from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList
    out = {}
    for name, given, own, kind in (("logits_processor", processors, _own_processor_types(gc, prefix_allowed),
                                    LogitsProcessorList),
                                   ("stopping_criteria", criteria, _own_criteria_types(gc),
                                    StoppingCriteriaList)):
        if given is None:
            continue
        items = list(given) if isinstance(given, (list, tuple)) else None
        if items is None or not all(callable(x) for x in items):  # (0 or False too, which generate refuses)
            return None, f"{name}={given!r} (expected a list of callables)"
        if not items:  # nothing to run
            continue
        same = sorted({type(x).__name__ for x in items if type(x) in own})
        if same:
            return None, f"{name} holding {', '.join(same)}, which replaces generate's own of that type"
        if name == "logits_processor" and batch_size > 1:
            return None, ("logits_processor at batch size > 1 (the loop runs it on one row at a time; patch with "
                          "row_processors=True if each row's scores depend on that row alone)")
        if name == "stopping_criteria" and gc.eos_token_id is None and any(hasattr(x, "eos_token_id") for x in items):
            return None, "a stopping criterion with an eos_token_id and no eos_token_id in the generation config"
        if name == "stopping_criteria" and gc.return_dict_in_generate and gc.output_scores:
            return None, ("stopping_criteria with output_scores (generate hands each criterion the scores so far, "
                          "which the loop holds per request until the call ends)")
        out[name] = kind(items)
    if gc.max_time is not None:
        out.setdefault("stopping_criteria", StoppingCriteriaList()).append(MaxTimeCriteria(gc.max_time))
    return out, None


def _check_token_ids(model, inputs):
    """input_ids of a dtype other than an integer one: a TypeError (generate's own error is the embedding's, and a
    one-token prompt never reaches the embedding as it is); ids outside the model's input embedding (generate's is
    the embedding's IndexError): a ValueError naming the argument, the range and the first such id."""
    if inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool:
        raise TypeError(f"input_ids: expected an integer tensor of token ids, got dtype {inputs.dtype}")
    rows = embedding_rows(model)
    if rows is None or inputs.numel() == 0:
        return
    bad = (inputs < 0) | (inputs >= rows)
    if bool(bad.any()):
        b, i = bad.nonzero()[0].tolist()
        raise ValueError(f"input_ids: token ids must lie in [0, {rows}) (the model's input embedding rows); got "
                         f"{int(inputs[b, i])} at [{b}, {i}]")


# what a module applies at random in training mode, read from its float attributes (transformers' modeling files
# keep dropout probabilities as ``dropout``, ``attention_dropout``, ``resid_pdrop``, ``drop_rate``, ...; layer drop as
# ``layerdrop``; a router's noise as ``jitter_noise``) and from its config's fields that forwards read directly
_RANDOM_ATTRIBUTES = ("drop", "jitter")
_RANDOM_CONFIG_FIELDS = ("dropout", "layerdrop")


def _random_in_training(model, mods):
    """Where the model's forward draws at random (``mods``: its modules): the first module in training mode that is
    a dropout of p > 0, a batch norm (its batch's statistics), or has a positive float attribute whose name holds
    ``_RANDOM_ATTRIBUTES``, or a config with a positive field named in ``_RANDOM_CONFIG_FIELDS`` or ending in
    ``_layerdrop``; as "name (what)". None for none: a model in eval mode, or one in training mode whose dropouts
    are all 0 (it computes as in eval mode)."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.dropout import _DropoutNd
    if not any(m.training for m in mods):
        return None
    configs = set()  # ids of the configs read so far (transformers' modules share one config)
    for name, m in model.named_modules():
        if not m.training:
            continue
        if isinstance(m, _DropoutNd) and m.p > 0:
            what = f"{type(m).__name__}(p={m.p})"
        elif isinstance(m, _BatchNorm):
            what = f"{type(m).__name__}, with its batch's statistics"
        else:
            found = [f"{k}={v}" for k, v in m.__dict__.items()
                     if type(v) is float and v > 0 and any(w in k for w in _RANDOM_ATTRIBUTES)]
            cfg = config_of(m)
            if cfg is not None and id(cfg) not in configs:
                configs.add(id(cfg))
                found += [f"config.{k}={v}" for k, v in vars(cfg).items() if type(v) is float and v > 0
                          and (k in _RANDOM_CONFIG_FIELDS or k.endswith("_layerdrop"))]
            if not found:
                continue
            what = found[0]
        return f"{name or type(m).__name__} ({what})"
    return None


# transformers' own hooks that change no value: ``enable_input_require_grads``'s on the input embedding (left by
# fine-tuning with adapters: it marks the output as needing gradients, which no_grad ignores)
_VALUELESS_HOOKS = ("make_inputs_require_grads",)


def _foreign(hook) -> bool:
    """A forward hook of someone else's: not transformers' output capturing (inactive unless a forward asks for
    hidden states, which the loop never does) or ``_VALUELESS_HOOKS``, not one of fastverify's own (the loop's hooks
    on the output projection while another thread's call runs)."""
    module = getattr(hook, "__module__", None) or ""
    return not (_capturing(hook) or module.startswith("fastverify.")
                or (module.startswith("transformers.") and getattr(hook, "__name__", "") in _VALUELESS_HOOKS))


def _foreign_hook_at(model, mods):
    """Where a forward hook or pre-hook of someone else's (``_foreign``) runs in ``mods``, the model's modules: the
    first such module's name, or "every module (a global module hook)"; None for none."""
    from torch.nn.modules import module as nn_module
    if any(_foreign(h) for hooks in (nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks)
           for h in hooks.values()):
        return "every module (a global module hook)"
    if not any(m._forward_hooks or m._forward_pre_hooks for m in mods):
        return None
    for name, m in model.named_modules():
        if any(_foreign(h) for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())):
            return name or type(m).__name__
    return None


_OWN_PACKAGES = ("transformers.", "torch.nn.", "fastverify.")


def _own(module_name) -> bool:
    return (module_name or "").startswith(_OWN_PACKAGES)


def _foreign_code(mods) -> tuple:
    """The code in ``mods`` from outside transformers, torch.nn and fastverify, by name, sorted: module classes (a
    user's own attention, an adapter library's layers, a checkpoint's remote code in ``transformers_modules``,
    torch.ao's dynamically quantized linears, whose one input scale for all rows is not row-invariant), and
    forwards bound over transformers' own (a class's ``forward`` replaced, as long-context patches do, as
    "Class.forward = module.function"; an instance's own, as "Class instance.forward = ..."). A type's registration
    vouches for transformers' code of it only, so a model that runs other code is checked as a type outside the
    registry is (fastverify.hf.probe), once per ``check_key`` and such code."""
    def foreign(forward):  # a forward's "module.name" where it is from outside, else None
        fn = getattr(forward, "__func__", forward)  # (a bound method's function)
        module = getattr(fn, "__module__", None)
        return None if forward is None or _own(module) else f"{module}.{getattr(fn, '__qualname__', type(fn).__name__)}"

    names = set()
    for cls in {type(m) for m in mods}:
        if not _own(cls.__module__):
            names.add(f"{cls.__module__}.{cls.__qualname__}")
        elif name := foreign(cls.__dict__.get("forward")):
            names.add(f"{cls.__qualname__}.forward = {name}")
    for m in mods:
        if name := foreign(m.__dict__.get("forward")):
            names.add(f"{type(m).__qualname__} instance.forward = {name}")
    return tuple(sorted(names))


@dataclasses.dataclass
class _Call:
    """A generate call's arguments, as generate reads them: ``kwargs`` holds the rest (generation-config fields
    and model inputs)."""
    inputs: torch.Tensor
    generation_config: object
    kwargs: dict
    seed: object = None
    streamer: object = None
    tokenizer: object = None  # (generate reads it for stop_strings only)
    processors: object = None
    criteria: object = None
    prefix_allowed: object = None
    assistant: object = None


# (_Call's field, generate's argument)
_CALL_ARGUMENTS = (("streamer", "streamer"), ("tokenizer", "tokenizer"), ("processors", "logits_processor"),
                   ("criteria", "stopping_criteria"), ("prefix_allowed", "prefix_allowed_tokens_fn"),
                   ("assistant", "assistant_model"))


def _read_call(args, kwargs):
    """(call, None), or (None, reason) for arguments the loop does not take."""
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", None)
    if seed is not None:
        _seed_list(seed)  # a clear error for a seed of another type, whatever the call decodes
    inputs = args[0] if args else kwargs.pop("inputs", None)
    if len(args) > 2:
        return None, "positional arguments beyond inputs and generation_config"
    generation_config = args[1] if len(args) > 1 else kwargs.pop("generation_config", None)
    if inputs is None:
        inputs = kwargs.pop("input_ids", None)
    else:
        kwargs.pop("input_ids", None)
    taken = {field: kwargs.pop(name, None) for field, name in _CALL_ARGUMENTS}
    call = _Call(inputs=inputs, generation_config=generation_config, kwargs=kwargs, seed=seed, **taken)
    if _is_set(kwargs.pop("synced_gpus", None)):
        return None, "synced_gpus is not supported"
    for name in ("negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate", "past_key_values",
                 "inputs_embeds", "assistant_tokenizer"):
        if kwargs.pop(name, None) is not None:  # (an empty value too: generate reads or refuses it)
            return None, f"{name} is not supported"
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2 or inputs.shape[1] == 0:
        return None, "input_ids must be a non-empty [batch, length] tensor"
    return call, None


def _plan(model, state, args, kwargs):
    """Decide whether the loop can run this generate call. Returns (plan dict, None) or (None, reason).

    In order: the call's arguments (``_read_call``), the model (its token ids, randomness in training mode, others'
    hooks), the generation config merged as generate merges it and the values generate refuses as it reads them
    (``_refused_as_generate_reads``), generate's processors and criteria for the call (``_call_processors``), a
    drafter the call names (``_call_drafter``), the attention implementation, the padding (``_left_padding``), the
    length (``_new_tokens``); then the loop's settings (sampling: ``_sampling``) and generate's warnings for the call
    (``_generate_warnings``, given where the loop decodes)."""
    call, reason = _read_call(args, kwargs)
    if reason:
        return None, reason
    inputs, generation_config, kwargs = call.inputs, call.generation_config, call.kwargs
    _check_token_ids(model, inputs)
    mods = modules(model)  # ~0.15 ms for SmolLM2's 400 modules
    reason = _model_refusal(model, state, mods) or _precision_refusal(model, inputs.device)
    if reason:
        return None, reason
    # generate's default lengths: no max_length (min_length) in the call, its config or the model's (``_new_tokens``)
    default_length, default_min = ((kwargs.get(name) is None and getattr(generation_config, name, None) is None
                                    and getattr(getattr(model, "generation_config", None), name, None) is None)
                                   for name in ("max_length", "min_length"))
    gc, model_kwargs = _generation_config(model, generation_config, kwargs)
    attention_mask = model_kwargs.pop("attention_mask", None)
    model_kwargs = {k: v for k, v in model_kwargs.items()
                    if k != "use_cache" and not (k in _NONE_MODEL_KWARGS and v is None)}
    if model_kwargs:
        return None, f"generate argument(s) {sorted(model_kwargs)} are not supported"
    reasons = _unsupported_config(gc)
    if reasons:
        return None, "generation option(s) " + ", ".join(reasons) + " are not supported"
    reason = _refused_as_generate_reads(gc, call.assistant, inputs.shape[1])
    if reason:
        return None, reason + " (generate's own error follows)"
    eos = _as_list(gc.eos_token_id)
    copies = max(1, gc.num_return_sequences)  # sampled sequences per prompt: generate's expand size (no beams here)
    warpers = None  # generate's sampling warpers, built once: their constructors check the values as generate's do
    if gc.do_sample:  # values generate's warpers refuse (temperature 0 when sampling, ...): its error, not greedy
        try:
            warpers = _warpers(gc, inputs.device)
        except ValueError as e:
            return None, f"a sampling warper's value: {str(e)[:80]} (generate's own error follows)"
    pads_ended = gc.eos_token_id is not None  # generate's eos criterion, which pads an ended row (an empty list too)
    scored = bool(gc.return_dict_in_generate) and bool(gc.output_scores or gc.output_logits)
    if scored and inputs.shape[0] * copies > 1 and pads_ended:
        return None, ("output_scores / output_logits at batch size > 1 with an eos_token_id (generate scores the "
                      "padding of a row that ended, which the loop does not run)")
    processors, reason = _call_processors(model, state, call, gc, eos, inputs, copies)
    if reason:
        return None, reason
    drafter, reason = _call_drafter(model, state, call, gc)
    if reason:
        return None, reason
    B, L = inputs.shape
    if call.streamer is not None and B * copies > 1:
        return None, "a streamer with batch size > 1"
    attn_impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if attn_impl == GQA_ATTENTION:  # another call of the loop on this model is running (gqa_attention)
        attn_impl = "sdpa"
    if attn_impl not in state.spec.attn_implementations:
        return None, (f"attention implementation {attn_impl!r} (the loop needs one that takes 4D masks: "
                      f"{state.spec.attn_implementations})")
    given_mask = attention_mask is not None
    attention_mask, pad, reason = _left_padding(inputs, attention_mask, gc.pad_token_id, eos)
    if reason:
        return None, reason
    as_generate = functools.partial(_generate_warnings, model, gc, inputs, given_mask, default_length, default_min)
    if copies > 1:  # generate's expansion: each prompt's copies next to each other
        inputs, attention_mask = inputs.repeat_interleave(copies, 0), attention_mask.repeat_interleave(copies, 0)
    max_new, reason = _new_tokens(model, state, gc, L, default_length)
    if reason:
        return None, reason
    sampling = bool(gc.do_sample)
    rule = state.rule or ("coupled" if sampling else "greedy")
    rule_params = {k: state.options[k] for k in RULE_PARAMS if k in state.options}
    if sampling and rule not in SAMPLING_RULES:
        warnings.warn(f"fastverify: rule {rule!r} does not sample; generate(do_sample=True) samples with the exact "
                      f"'coupled' rule instead (patch with rule='speculative' or 'coupled' to choose)", UserWarning,
                      stacklevel=4)
        rule, rule_params = "coupled", {}
    settings = DecodeSettings(max_new_tokens=int(max_new), eos_token_ids=eos, pad_token_id=pad, rule=rule,
                              pads_ended=pads_ended,
                              max_draft=int(state.options.get("max_draft", 32)),
                              backend=state.options.get("backend", "auto"), sync=bool(state.options.get("sync")),
                              **{name: bool(state.options.get(name, True)) for name in _LOOP_SWITCHES},
                              max_positions=position_limit(model.config), window=loop_window(model.config),
                              min_tokens=_min_tokens(gc, L), **processors)
    settings.rule_params = rule_params
    settings.remove_invalid = bool(gc.remove_invalid_values)
    _sampling(settings, gc, warpers, scored, call.seed, B, copies, inputs.device)
    return {"inputs": inputs, "attention_mask": attention_mask, "settings": settings, "streamer": call.streamer,
            "return_dict": bool(gc.return_dict_in_generate), "drafter": drafter or state.drafter,
            "foreign": _foreign_code(mods), "generate_warnings": as_generate}, None


def _generate_warnings(model, gc, inputs, given_mask: bool, default_length: bool, default_min: bool):
    """The warnings generate gives as it prepares a call, for a call the loop runs: both max_new_tokens and
    max_length set (or both minimums), the model-agnostic default length, minimum lengths past the maximum, a batch
    without attention mask whose pad is an eos, an eos that is no positive integer, a prompt ending in its pad.
    Through generate's own methods, on the call's config (a copy: ``_generation_config``), so that their
    conditions and wording are the running release's; the right padding check is inline in generate, repeated here
    (the loop refuses masks that end in padding, so only the check on the last tokens can warn). Called where the
    loop decodes, after the fallbacks, so that no warning comes twice. Returns generate's max_length for the call
    (``_warn_past_positions``)."""
    B = inputs.shape[0]
    model._prepare_special_tokens(gc, given_mask, device=inputs.device, batch_size=B)
    pad = gc._pad_token_tensor
    if B > 1 and not given_mask and pad is not None and bool((inputs[:, -1] == pad).any()):
        from transformers.generation.utils import logger
        logger.warning("A decoder-only architecture is being used, but right-padding was detected! For correct "
                       "generation results, please set `padding_side='left'` when initializing the tokenizer.")
    gc = model._prepare_generated_length(generation_config=gc, has_default_max_length=default_length,
                                         has_default_min_length=default_min, model_input_name="input_ids",
                                         input_ids_length=inputs.shape[1], inputs_tensor=inputs)
    model._validate_generated_length(gc, inputs.shape[1], default_length)
    return gc.max_length


def _warn_past_positions(model, max_length, L: int, T: int):
    """generate's reminder that a call ran past the model's max_position_embeddings, from its own length criterion
    asked as generate asks it after each token: where the batch reached a length in (max_position_embeddings,
    max_length) (``L``: the padded prompt's length, ``T``: the output's)."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is None or max_length is None:
        return
    length = max(L, positions) + 1
    if length <= min(T, max_length - 1):
        from transformers.generation.stopping_criteria import MaxLengthCriteria
        MaxLengthCriteria(max_length, positions)(torch.empty(1, length, dtype=torch.long), None)


def _model_refusal(model, state, mods):
    """Why the loop cannot drive the model as it is now (``mods``: its modules), or None: randomness in training
    mode (``_random_in_training``), or someone else's forward hooks (``_foreign_hook_at``)."""
    random = _random_in_training(model, mods)
    if random is not None:
        return (f"the model is in training mode, and {random} draws at random in every forward: drafted "
                f"forwards cannot follow its draws (model.eval() decodes with the loop)")
    hooked = None if state.options.get("row_hooks", False) else _foreign_hook_at(model, mods)
    if hooked is not None:
        return (f"a forward hook on {hooked}: the loop's forwards hold a request's draft rows after its "
                f"committed ones (and a long prompt in chunks), so a hook that picks rows by position acts "
                f"otherwise than in generate (patch(model, row_hooks=True) declares hooks that compute each "
                f"row from that row alone, and the loop then runs with them)")
    return None


def _precision_refusal(model, device):
    """Why generate would compute in another precision than the loop's kernels, or None: ``torch.autocast`` on for
    the inputs' device (generate's forwards then run its ops in the autocast dtype), or float32 matmuls on the CPU
    that torch is set to round through a lower precision (``torch.set_float32_matmul_precision("medium")``: oneDNN's
    bfloat16) where they do so on this machine (``_matmul_rounds``). The loop's kernels compute in the model's
    dtype either way, so its tokens would be the model's own, not those of generate under the setting."""
    if torch.is_autocast_enabled(device.type):
        dtype = str(torch.get_autocast_dtype(device.type)).replace("torch.", "")
        return (f"torch.autocast is on for {device.type} ({dtype}): generate's forwards compute in {dtype} there, "
                f"the loop's kernels in the model's dtype")
    precision = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    precision = getattr(precision, "fp32_precision", "ieee")
    if device.type == "cpu" and precision not in ("ieee", "none") and model_dtype(model) == torch.float32 \
            and _matmul_rounds(precision):
        return (f"float32 matmul precision {precision!r} (torch.set_float32_matmul_precision / "
                f"torch.backends.mkldnn.matmul.fp32_precision): generate's float32 matmuls on this CPU round "
                f"through it, the loop's kernels compute in float32")
    return None


@functools.lru_cache(maxsize=None)
def _matmul_rounds(precision: str) -> bool:
    """Whether float32 matmuls on the CPU round below float32 under oneDNN's ``precision`` on this machine: a
    [8, 256] x [256, 256] ``F.linear`` against float64, once per precision (bfloat16 rounds to ~2e-3 of the largest
    output, float32 to ~5e-7; the threshold 1e-5)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, generator=g, dtype=torch.float32)
    w = torch.randn(256, 256, generator=g, dtype=torch.float32)
    ref = x.double() @ w.double().T
    return bool((torch.nn.functional.linear(x, w).double() - ref).abs().max() > 1e-5 * ref.abs().max())


def _left_padding(inputs, attention_mask, pad, eos):
    """The call's attention mask as generate makes it (from pad_token_id where none is given) and the loop's pad id:
    (mask, pad, None), or (None, None, reason) for a mask that is not left padding."""
    pad = int(pad[0] if isinstance(pad, (list, tuple)) else pad) if pad is not None else None
    if attention_mask is None:
        if pad is not None and pad not in eos and bool((inputs == pad).any()):
            attention_mask = (inputs != pad).long()
        else:
            attention_mask = torch.ones_like(inputs)
    if attention_mask.shape != inputs.shape:
        return None, None, "attention_mask of a shape other than input_ids'"
    am = attention_mask.bool()
    if not bool(am[:, -1].all()) or bool((am[:, 1:].int() < am[:, :-1].int()).any()):
        return None, None, "attention_mask that is not left padding"
    if pad is None:
        pad = eos[0] if eos else 0
    return attention_mask, pad, None


def _new_tokens(model, state, gc, L: int, default_length: bool):
    """The new tokens generate makes after a (padded) prompt of L tokens: (max_new, None), or (None, reason) where
    that is none or more than the loop decodes exactly. ``default_length``: no max_length in the call, its config
    or the model's, where generate makes max_length new tokens past the prompt, at most the model's
    max_position_embeddings in all (else max_length counts the prompt too)."""
    if gc.max_new_tokens is not None:
        max_new = gc.max_new_tokens
    elif default_length:
        length = 20 if gc.max_length is None else gc.max_length
        positions = getattr(model.config, "max_position_embeddings", None)
        max_new = length if positions is None else min(length + L, positions) - L
    else:
        max_new = gc.max_length - L
    if max_new is None or max_new <= 0:
        return None, f"max_new_tokens = {max_new} (nothing to generate)"
    limit, what = sequence_limit(model.config, state.spec.sliding_window_attr)
    if limit == 0:
        return None, f"the model's {what}"
    if limit is not None and L + max_new > limit:
        return None, (f"sequence length {L} + {max_new} new tokens beyond {what}: the loop attends with full "
                      f"attention and one RoPE, exact only up to {limit} tokens")
    return max_new, None


def _sampling(settings, gc, warpers, scored: bool, seed, prompts: int, copies: int, device):
    """A sampling rule's warping and seeds (one per returned sequence: ``copies`` of each of ``prompts``), and the
    warpers the scores go through, on ``settings``. ``warpers``: generate's sampling warpers, built where the call
    samples."""
    sampling, rule = bool(gc.do_sample), settings.rule
    # a warper the verify op does not have: the loop warps the verify rows with generate's whole chain
    torch_warped = (sampling and rule in SAMPLING_RULES
                    and any(isinstance(w, _torch_only_warpers()) for w in warpers))
    if scored:
        settings.output_scores, settings.output_logits = bool(gc.output_scores), bool(gc.output_logits)
        settings.renormalize = bool(gc.renormalize_logits)
        if sampling and gc.output_scores and not torch_warped:
            settings.warpers = warpers
    if rule in SAMPLING_RULES:
        if torch_warped:  # generate's warpers on the verify rows; the verify op samples them as they are
            settings.warp_rows, settings.warp = warpers, {"temperature": 1.0}
        elif sampling:
            # as generate builds its warpers: top_p >= 1 none; top_p 0 keeps its one token to keep, the most
            # probable (as top_k 1)
            top_p = float(gc.top_p if gc.top_p is not None else 1.0)
            settings.warp = {"temperature": float(gc.temperature if gc.temperature is not None else 1.0),
                             "top_k": 1 if top_p == 0 else int(gc.top_k or 0), "top_p": top_p if 0 < top_p < 1 else 1.0,
                             "min_p": float(gc.min_p or 0.0)}
        else:  # a sampling rule asked for without do_sample: greedy, as temperature 0
            settings.warp = {"temperature": 0.0}
        if seed is None:  # torch's global generator, so torch.manual_seed makes runs reproducible
            seed_t = torch.randint(0, 2 ** 62, (prompts * copies,), dtype=torch.int64)
        else:
            seed_t = _request_seeds(seed, prompts, copies)
        settings.seed = seed_t.to(device)


def _warpers(gc, device):
    """generate's sampling warpers for the generation config, in its order, as its ``_get_logits_processor`` builds
    them for one sequence per beam: the scores output_scores returns when sampling, and the verify rows' warping
    where the config asks for a warper the verify op does not have (``_torch_only_warpers``)."""
    from transformers.generation import logits_process as lp
    out = lp.LogitsProcessorList()
    if gc.temperature is not None and gc.temperature != 1.0:
        out.append(lp.TemperatureLogitsWarper(gc.temperature))
    if getattr(gc, "top_h", None) is not None:
        out.append(lp.TopHLogitsWarper(top_h=gc.top_h))
    if gc.top_k is not None and gc.top_k != 0:
        out.append(lp.TopKLogitsWarper(top_k=gc.top_k, min_tokens_to_keep=1))
    if gc.top_p is not None and gc.top_p < 1.0:
        out.append(lp.TopPLogitsWarper(top_p=gc.top_p, min_tokens_to_keep=1))
    if gc.min_p is not None:
        out.append(lp.MinPLogitsWarper(min_p=gc.min_p, min_tokens_to_keep=1))
    if gc.typical_p is not None and gc.typical_p < 1.0:
        out.append(lp.TypicalLogitsWarper(mass=gc.typical_p, min_tokens_to_keep=1))
    if gc.epsilon_cutoff is not None and 0.0 < gc.epsilon_cutoff < 1.0:
        out.append(lp.EpsilonLogitsWarper(epsilon=gc.epsilon_cutoff, min_tokens_to_keep=1))
    if gc.eta_cutoff is not None and 0.0 < gc.eta_cutoff < 1.0:
        out.append(lp.EtaLogitsWarper(epsilon=gc.eta_cutoff, min_tokens_to_keep=1, device=device))
    return out


def _torch_only_warpers() -> tuple:
    """The warper classes of ``_warpers`` the verify op does not have (typical_p, epsilon_cutoff, eta_cutoff, top_h)."""
    from transformers.generation import logits_process as lp
    return (lp.TypicalLogitsWarper, lp.EpsilonLogitsWarper, lp.EtaLogitsWarper, lp.TopHLogitsWarper)


def _seed_list(seed) -> list:
    """``seed=`` as a list of Python ints: an int, a list / tuple of ints or an integer tensor; else a ValueError."""
    if isinstance(seed, torch.Tensor):
        if seed.is_floating_point() or seed.is_complex() or seed.dtype == torch.bool:
            raise ValueError(f"seed: expected an integer tensor, got dtype {seed.dtype}")
        return seed.reshape(-1).tolist()
    items = list(seed) if isinstance(seed, (list, tuple)) else [seed]
    try:
        if not items or any(isinstance(s, bool) for s in items):
            raise TypeError
        return [operator.index(s) for s in items]  # ints, numpy's integers
    except TypeError:
        raise ValueError(f"seed: expected an int, a list of ints or an integer tensor, got {seed!r}") from None


def _request_seeds(seed, prompts: int, copies: int) -> torch.Tensor:
    """``seed=`` as one seed per returned sequence (int64 [prompts * copies]): an int for every prompt, one per
    prompt, or one per returned sequence. A prompt's copies (num_return_sequences) sample different sequences: copy j
    of seed s draws from seed s + j * 0x9E3779B97F4A7C15 (mod 2^63; copy 0 from s itself, so one copy is the seed's
    own sampling)."""
    seeds = _seed_list(seed)
    if len(seeds) == prompts * copies:
        return torch.tensor(seeds, dtype=torch.int64)
    if len(seeds) == 1:
        seeds = seeds * prompts
    if len(seeds) != prompts:
        expected = f"an int or {prompts} ints (one per request)" + (f" or {prompts * copies} (one per returned "
                                                                      f"sequence)" if copies > 1 else "")
        raise ValueError(f"seed: expected {expected}, got {len(seeds)}")
    return torch.tensor([s if j == 0 else (s + j * 0x9E3779B97F4A7C15) % 2 ** 63 for s in seeds
                         for j in range(copies)], dtype=torch.int64)


def _fallback(model, state, reason, args, kwargs):
    """Run the original generate. A ``seed`` (fastverify's own argument) seeds torch's generators for that call
    only (``torch.random.fork_rng``): two calls with one seed give one output, though not the tokens of the
    loop's own seeded sampling (another random stream). Per-request seeds cannot be honoured: the first one
    seeds the whole batch, and the warning says so. Under ``model_lock``, as the loop: a call falling back waits for
    another thread's loop over the model, whose rebound modules it would otherwise run through."""
    seed = kwargs.pop("seed", None)
    seeds = None if seed is None else _seed_list(seed)
    if seeds:
        reason += f"; seed {seeds[0]} seeds torch's generators for the original generate"
        if len(set(seeds)) > 1:
            reason += " (one seed for the whole batch: the first of the per-request seeds)"
    warnings.warn(f"fastverify: falling back to the original generate: {reason}", UserWarning, stacklevel=4)
    original = _original_generate(model, state)
    with model_lock(model):  # on the model's own modules, never under another thread's loop
        state.last_stats = None
        if not seeds:
            return original(*args, **kwargs)
        device = getattr(model, "device", torch.device("cpu"))
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seeds[0])
            return original(*args, **kwargs)


def _warn_precision(model, state, rule):
    """Once per patch: a half-precision model's greedy / coupled output is generate's only up to rounding."""
    dtype = model_dtype(model)
    if state.warned_precision or rule not in ("greedy", "coupled") or dtype not in (torch.float16, torch.bfloat16):
        return
    state.warned_precision = True
    name = str(dtype).replace("torch.", "")
    warnings.warn(f"fastverify: model dtype {name}: a verify forward scores several rows at once and rounds "
                  f"differently from one-row decoding, so where two tokens' logits lie within {name} rounding of "
                  f"each other (ties are common at this precision) the output may take the other token, as "
                  f"transformers' assisted decoding may; in float32 the differences are of float32 rounding "
                  f"(warned once per patch)", UserWarning, stacklevel=4)


def _sample_row_invariant(model, state, plan):
    """Seeded sampling under the coupled rule draws each token as undrafted decoding would, draw for draw, where the
    loop's forwards are row-invariant (a sampled row's logits the same bits beside draft rows: docs/hf.md, "Exactness").
    Checked once per setup (``probe.check_rows``, kept as the probe's verdicts are); where they are not, this call
    samples without drafts (its draws those of the seeded stream), with a warning."""
    settings = plan["settings"]
    if (settings.rule != "coupled" or settings.warp.get("temperature", 0.0) <= 0 or type(plan["drafter"]) is Drafter
            or not state.options.get("invariant_sampling", True)):
        return
    key = check_key(model, settings)
    verdicts = state.__dict__.setdefault("row_checks", {})  # a model pickled with an earlier state has none
    if key not in verdicts:
        verdicts[key] = check_rows(model, settings) or ""
    if verdicts[key]:
        warnings.warn(f"fastverify: sampling without drafts: this model's verify forward is not row-invariant "
                      f"({verdicts[key]}), so a drafted step could draw another token than the seeded stream's "
                      f"(fastverify.hf.probe.check_rows; patch with invariant_sampling=False to draft anyway: the same "
                      f"distribution, a draw possibly another at a near-tie)", UserWarning, stacklevel=4)
        plan["drafter"] = Drafter()


def _patched_generate(self, *args, **kwargs):
    state = self.__dict__[_STATE_ATTR]
    plan, reason = _plan(self, state, args, kwargs)
    if plan is None:
        return _fallback(self, state, reason, args, kwargs)
    with model_lock(self):  # the check's own generate and decode calls too, never beside another thread's loop
        if state.unregistered or plan["foreign"] or _untested_transformers():
            key = (check_key(self, plan["settings"]), plan["foreign"])
            checks = state.__dict__.setdefault("checks", {})  # a model pickled with an earlier state has none
            if key not in checks:
                checks[key] = check_model(self, _original_generate(self, state), plan["settings"]) or ""
            if checks[key]:
                import transformers
                what = (f"model type {self.config.model_type!r} is not registered and failed the loop's check of it"
                        if state.unregistered else
                        f"a model of type {self.config.model_type!r} running code from outside transformers "
                        f"({', '.join(plan['foreign'])}) failed the loop's check of it" if plan["foreign"] else
                        f"transformers {transformers.__version__} is later than the releases the registry was tested "
                        f"on (<= {TESTED_TRANSFORMERS}), and a model of type {self.config.model_type!r} failed the "
                        f"loop's check of it")
                return _fallback(self, state, f"{what} (fastverify.hf.probe): {checks[key]}", args, kwargs)
        max_length = plan["generate_warnings"]()
        _warn_precision(self, state, plan["settings"].rule)
        _sample_row_invariant(self, state, plan)
        record = {}
        sequences, loop_stats = decode(self, plan["inputs"], plan["attention_mask"], plan["drafter"],
                                       plan["settings"], plan["streamer"], record=record)
        _warn_past_positions(self, max_length, plan["inputs"].shape[1], sequences.shape[1])
        state.last_stats = loop_stats
    if plan["return_dict"]:  # generate's output (no cache: the loop's is in its own per-request layout)
        from transformers.generation.utils import GenerateDecoderOnlyOutput
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=record.get("scores"),
                                         logits=record.get("logits"))
    return sequences
