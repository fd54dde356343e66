"""Mixture-of-experts layers through the skinny kernels while the loop runs, one request's row at a time.

transformers' experts modules (``@use_experts_implementation``: Mixtral, Qwen2 / Qwen3 MoE, OLMoE, DeepSeek V2 / V3
and 20 more registered types) keep every expert's weights in one 3-D tensor and dispatch their forward through
``ALL_EXPERTS_FUNCTIONS`` by ``config._experts_implementation`` ("grouped_mm" by default). Those implementations
compute an expert's rows in one GEMM, whose rounding depends on how many rows reached the expert, so a verify
forward's row rounds differently beside draft rows and batch-mates. Within ``skinny_experts(model)``, a CPU model's
experts run ``skinny_experts_forward`` instead (registered under ``EXPERTS_IMPLEMENTATION``, the configs switched
and then restored, as ``fastverify.hf.attention.gqa_attention`` switches sdpa): the same computation as transformers'
``batched_mm`` implementation (each token's row repeated for its top-k experts, the experts' projections, the gate,
the routing weights, the sum over the top k), each expert's float32 rows through ``skinny_linear`` (or
``skinny_linear_t`` for weights stored [in, out]), whose rows do not depend on each other, and the top k summed in
order. The routers that choose each token's experts (``*TopKRouter``: ``F.linear`` on a weight of their own) run,
for the same duration, with the ``F`` of their modeling file bound to ``torch.nn.functional`` but for ``linear``
(and its ``nn`` to ``torch.nn`` but for that ``functional``, for routers that call ``nn.functional.linear``),
which takes few float32 CPU rows to ``skinny_linear`` (``_row_linear``, bound by ``attention.module_globals``:
process-wide for that file while any loop runs such a model, the file's own ``F.linear`` on every thread outside the
loop's contexts: ``linear.substitutes_here``), its outputs of fewer than 32 columns row-aligned
(``linear.row_aligned``: the sigmoid that some routers take of their logits then computes each row alone). Experts layers of a modeling file's own code
take the same kernels: the files whose experts call ``F.linear`` per expert (JetMoE, LongCat-Flash) have their ``F``
bound likewise; DBRX's expert GLU, which multiplies with tensor methods, runs ``_glu_rows`` for the duration, and
Llama 4's experts (``torch.bmm`` over each expert's rows) and router (``nn.Linear.forward``, then a sigmoid of the
scores it makes) run ``_bmm_experts_rows`` and ``_router_rows``, and Kolibri's router (the sigmoid of gathered
logits, a tensor method) ``_gathered_router_rows``. One file's own code beside experts takes the same ``F``: Laguna's
attention, whose softplus of a gate 48 columns wide would otherwise round the last row's tail by the rows before it.
So a row's result is a function of that row alone, as the rest of the loop's forward is on the CPU.
"""

import contextlib

import torch
import torch.nn.functional as F

from fastverify.hf.attention import ModuleWith, bound_methods, files_of, module_globals, switched, switched_from
from fastverify.hf.linear import (MAX_ROWS, config_of, modules, row_aligned, row_padded, skinny_available,
                                  streamable, substitutes_here, substituting, takes_skinny)
from fastverify.ops.tree import implemented_backends

__all__ = ["skinny_experts", "skinny_experts_forward", "EXPERTS_IMPLEMENTATION"]

EXPERTS_IMPLEMENTATION = "fastverify_rows"


def _project(x, weights, biases, experts, transposed: bool):
    """Each expert e's rows of x, projected by it (``experts``: (e, its rows' indices); weights [E, out, in], or
    [E, in, out] when ``transposed``; biases [E, out] or None); rows of no expert (an expert-parallel sentinel)
    stay 0. Float32 CPU rows, at most MAX_ROWS per expert, go through the skinny kernels; anything else through
    F.linear."""
    out_dim = weights.shape[2] if transposed else weights.shape[1]
    out = x.new_zeros(x.shape[0], out_dim)
    skinny = skinny_available()
    for e, rows in experts:
        xe, w, b = x[rows], weights[e], None if biases is None else biases[e]
        if skinny and _few_rows(xe, w, b):
            op = torch.ops.fastverify.skinny_linear_t if transposed else torch.ops.fastverify.skinny_linear
            out[rows] = op(xe, w, b)
        else:
            out[rows] = F.linear(xe, w.T if transposed else w, b)
    return out


def skinny_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """An experts module's forward (``use_experts_implementation``'s signature and attributes: has_gate, has_bias,
    is_transposed, has_post_expert_norm, _apply_gate), row by row: see the module docstring. On a thread outside the
    loop's contexts (another thread's forward of the model meanwhile), the implementation its config had before
    ``skinny_experts`` switched it."""
    before = None if substitutes_here() else switched_from(self.config, "_experts_implementation")
    if before is not None:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        original = getattr(type(self).forward, "__wrapped__", type(self).forward)  # the class's own (eager) forward
        return ALL_EXPERTS_FUNCTIONS.get_interface(before, original)(self, hidden_states, top_k_index, top_k_weights)
    tokens, k = hidden_states.shape[0], top_k_index.shape[-1]
    x = hidden_states.repeat_interleave(k, dim=0)  # (tokens * k, hidden): each token once per chosen expert
    ids = top_k_index.reshape(-1)
    num_experts = (self.gate_up_proj if self.has_gate else self.up_proj).shape[0]
    experts = [(e, (ids == e).nonzero().squeeze(1)) for e in ids.unique().tolist() if 0 <= e < num_experts]
    up, up_bias = ((self.gate_up_proj, getattr(self, "gate_up_proj_bias", None)) if self.has_gate
                   else (self.up_proj, getattr(self, "up_proj_bias", None)))
    h = _project(x, up, up_bias if self.has_bias else None, experts, self.is_transposed)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    h = _project(h, self.down_proj, getattr(self, "down_proj_bias", None) if self.has_bias else None, experts,
                 self.is_transposed)
    if getattr(self, "has_post_expert_norm", False):  # (transformers >= 5.18)
        h = self.post_expert_norm(h)
    h = (h * top_k_weights.reshape(-1, 1).to(h.dtype)).view(tokens, k, -1)
    out = h[:, 0]
    for j in range(1, k):  # the top k in order, each token's own sum
        out = out + h[:, j]
    return out.to(hidden_states.dtype)


def _few_rows(x, weight, bias=None) -> bool:
    """Whether ``F.linear(x, weight, bias)`` goes to the skinny kernels: a weight they stream in place
    (``streamable``) and an input the loop's linear layers give them (``takes_skinny``: float32, at most MAX_ROWS
    rows, nothing that needs gradients) on the CPU."""
    return x.device.type == "cpu" and streamable(weight, bias) and takes_skinny(x, weight, MAX_ROWS)


def _row_linear(x, weight, bias=None):
    """``F.linear``, with few float32 CPU rows (``_few_rows``) on ``skinny_linear``, its output row-aligned."""
    if _few_rows(x, weight, bias):
        return row_aligned(torch.ops.fastverify.skinny_linear(x, weight, bias))
    return F.linear(x, weight, bias)


def _row_softplus(x, beta=1.0, threshold=20.0):
    """``F.softplus``, of a CPU input's rows one at a time (``row_padded``)."""
    return F.softplus(row_padded(x) if x.device.type == "cpu" else x, beta, threshold)


_ROW_F = ModuleWith(F, linear=_row_linear, softplus=_row_softplus)  # torch.nn.functional but for these
_ROW_NN = ModuleWith(torch.nn, functional=_ROW_F)  # torch.nn, for routers that call nn.functional.linear (Aria)


# modeling files whose own code needs ``_ROW_F`` and whose ``F`` is bound to it as routers' files are: experts layers
# calling ``F.linear`` per expert (JetMoE's parallel experts, LongCat-Flash's experts and router), and Laguna's
# attention, which gates each head by the softplus of a linear layer's output one column per head (48 in its release)
_OWN_CODE_FILES = ("transformers.models.jetmoe.modeling_jetmoe",
                   "transformers.models.longcat_flash.modeling_longcat_flash",
                   "transformers.models.laguna.modeling_laguna")


def _glu_rows(self, x, expert_w1, expert_v1, expert_w2):
    """DBRX's expert GLU (``DbrxExpertGLU``: act(x w1^T) * x v1^T, then @ w2, w2 [ffn, hidden]) with few float32 CPU
    rows on the skinny kernels, outputs row-aligned as ``_ROW_F``'s; anything else through the class's own forward."""
    if not (skinny_available() and all(_few_rows(x, w) for w in (expert_w1, expert_v1))
            and streamable(expert_w2) and expert_w2.shape[0] == expert_w1.shape[0]):
        return type(self).forward(self, x, expert_w1, expert_v1, expert_w2)
    ops = torch.ops.fastverify
    h = self.activation_fn(row_aligned(ops.skinny_linear(x, expert_w1, None))) * row_aligned(
        ops.skinny_linear(x, expert_v1, None))
    return row_aligned(ops.skinny_linear_t(h, expert_w2, None))


def _bmm_experts_rows(self, hidden_states):
    """Llama 4's experts (``Llama4TextExperts``: every token's row once per expert, [E * tokens, hidden], through
    ``torch.bmm`` with gate_up_proj [E, hidden, 2 * ffn] and down_proj [E, ffn, hidden]), each expert's few float32
    CPU rows on ``skinny_linear_t``; anything else through the class's own forward."""
    experts, gate_up, down = self.gate_up_proj.shape[0], self.gate_up_proj, self.down_proj
    x = hidden_states.view(experts, -1, self.hidden_size)
    if not (skinny_available() and all(_few_rows(x[0], w) for w in (gate_up[0], down[0]))):
        return type(self).forward(self, hidden_states)
    ops = torch.ops.fastverify
    out = []
    for e in range(experts):
        gate, up = ops.skinny_linear_t(x[e], gate_up[e], None).chunk(2, dim=-1)
        out.append(ops.skinny_linear_t(up * self.act_fn(gate), down[e], None))
    return torch.cat(out)


def _router_rows(self, hidden_states):
    """Llama 4's router (``Llama4Router``, an ``nn.Linear`` with a forward of its own: the logits, the top k kept,
    their sigmoid), its logits from ``skinny_linear`` and the sigmoid taken of row-aligned scores, with few float32 CPU
    rows; anything else through the class's own forward."""
    if not (skinny_available() and _few_rows(hidden_states, self.weight, self.bias)):
        return type(self).forward(self, hidden_states)
    logits = row_aligned(torch.ops.fastverify.skinny_linear(hidden_states, self.weight, self.bias))
    top_value, top_index = torch.topk(logits, self.top_k, dim=1)
    scores = torch.full_like(logits, float("-inf")).scatter_(1, top_index, top_value)
    return torch.sigmoid(row_aligned(scores.float())).to(scores.dtype), logits


def _gathered_router_rows(self, hidden_states):
    """Kolibri's router (``Kolibri1TopKRouter``: float32 logits, the top k of the logits plus a correction bias, the
    sigmoid of the logits gathered there, as a tensor method, normalised if asked), its logits from ``skinny_linear``
    and the sigmoid taken of row-padded scores, with few float32 CPU rows; anything else through the class's own
    forward."""
    x = hidden_states.reshape(-1, self.hidden_dim)
    if not (skinny_available() and _few_rows(x, self.weight)):
        return type(self).forward(self, hidden_states)
    logits = row_aligned(torch.ops.fastverify.skinny_linear(x, self.weight, None))
    index = torch.topk(logits + self.e_score_correction_bias, self.top_k, dim=-1)[1]
    scores = row_padded(logits.gather(1, index)).sigmoid()
    if self.norm_topk_prob:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return logits, scores, index


def _grouped_gemm_rows(self, x, tokens_per_expert):
    """Aria's expert GEMM before transformers 5.18 (``AriaGroupedExpertsGemm``: the tokens' rows sorted by expert,
    each expert's through ``torch.matmul`` with its weight [in, out]), each expert's float32 CPU rows on
    ``skinny_linear_t`` where no expert has more than MAX_ROWS; anything else through the class's own forward."""
    counts = tokens_per_expert.tolist() if x.device.type == "cpu" else []
    if not (skinny_available() and counts and max(counts) <= MAX_ROWS and _few_rows(x[:1], self.weight[0])):
        return type(self).forward(self, x, tokens_per_expert)
    out, start = x.new_zeros(x.shape[0], self.weight.shape[-1]), 0
    for e, n in enumerate(counts):
        if n:
            out[start:start + n] = torch.ops.fastverify.skinny_linear_t(x[start:start + n], self.weight[e], None)
        start += n
    return out


# modules of a modeling file's own code whose arithmetic depends on the number of rows, and the forward each runs
# instead while the loop does: DBRX's expert GLU (tensor methods, ``x.matmul(w1.T)``), Llama 4's experts
# (``torch.bmm`` over every expert's rows) and router (``nn.Linear.forward``, then a sigmoid of new scores), Kolibri's
# router (the sigmoid of gathered logits, a tensor method), Aria's expert GEMM before transformers 5.18
_OWN_FORWARDS = {("transformers.models.dbrx.modeling_dbrx", "DbrxExpertGLU"): ("forward", _glu_rows),
                 ("transformers.models.llama4.modeling_llama4", "Llama4TextExperts"): ("forward", _bmm_experts_rows),
                 ("transformers.models.llama4.modeling_llama4", "Llama4Router"): ("forward", _router_rows),
                 ("transformers.models.kolibri1.modeling_kolibri1", "Kolibri1TopKRouter"):
                     ("forward", _gathered_router_rows),
                 ("transformers.models.aria.modeling_aria", "AriaGroupedExpertsGemm"): ("forward", _grouped_gemm_rows)}


def _is_router(cls) -> bool:
    return cls.__name__.lower().endswith("router")


def _has_own_code(cls) -> bool:
    return cls.__module__ in _OWN_CODE_FILES


def _register() -> bool:
    """Register ``skinny_experts_forward`` once; False where this transformers has no experts interface."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    if EXPERTS_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, skinny_experts_forward)
    return True


def _experts_configs(model) -> list:
    """The configs that a CPU model's experts modules dispatch by (each once). Such a module's ``has_gate`` and
    ``is_transposed`` are instance attributes (``use_experts_implementation``'s ``__init__`` sets them): looked up in
    its ``__dict__``, as ``config_of`` looks up the config (``hasattr`` on a module without them raises and catches in
    nn.Module's ``__getattr__``, ~250 us a call over a 30-layer model's modules)."""
    configs, seen = [], set()
    for m in modules(model):
        cfg = config_of(m)
        if (cfg is not None and id(cfg) not in seen and "has_gate" in m.__dict__ and "is_transposed" in m.__dict__
                and getattr(cfg, "_experts_implementation", None) is not None):
            seen.add(id(cfg))
            configs.append(cfg)
    return configs


@contextlib.contextmanager
def skinny_experts(model):
    """For the loop's duration, a CPU model's experts modules run ``skinny_experts_forward`` (their configs'
    ``_experts_implementation`` switched to ``EXPERTS_IMPLEMENTATION``, then restored) and its routers' ``F.linear``
    the skinny kernel; a modeling file's own code too: the ``F.linear`` and ``F.softplus`` of the files in
    ``_OWN_CODE_FILES`` (JetMoE's and LongCat-Flash's experts, Laguna's attention gate) and the modules of
    ``_OWN_FORWARDS`` (DBRX's expert GLU, Llama 4's experts and router, Kolibri's router).
    Yields how many configs were switched. Other models and devices are left as they are."""
    configs, f_files, nn_files, own = [], [], [], {}
    if (skinny_available() and "cpp" in implemented_backends("skinny_linear_t")
            and next(model.parameters()).device.type == "cpu"):
        configs = _experts_configs(model) if _register() else []
        if configs:
            f_files = files_of(model, _is_router, "F", F, _ROW_F)
            nn_files = files_of(model, _is_router, "nn", torch.nn, _ROW_NN)
        f_files += [mod for mod in files_of(model, _has_own_code, "F", F, _ROW_F) if mod not in f_files]
        own = _OWN_FORWARDS
    with (switched(configs, "_experts_implementation", EXPERTS_IMPLEMENTATION), bound_methods(model, own),
          module_globals(f_files, "F", _ROW_F), module_globals(nn_files, "nn", _ROW_NN), substituting()):
        yield len(configs)
