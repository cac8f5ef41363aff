"""The dense part of a model: :class:`DenseHead` (a DeepFM or LR head over pooled slot embeddings,
first-order terms and dense features), its slopes for the sequential kernels
(:class:`HeadSlopes`), and its optimizer (:func:`make_dense_optimizer`)."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .content import ContentEncoder
from .dense_scaling import DenseScaler, merge_moments_before_step
from .torch_quirks import optimizer_class

__all__ = ["DenseHead", "HeadSlopes", "load_dense_optimizer", "load_optimizer_state", "make_dense_optimizer"]

log = logging.getLogger(__name__)

#: the name of :func:`make_dense_optimizer`'s parameter group of the first-order factors
FACTORS = "linear_scale"


class DenseHead(nn.Module):
    """``forward(emb [B, F, D] or None, lin [B, L] or None, dense [B, K] or None) -> logits [B]``;
    ``dense`` as :meth:`scale_dense` returns it (:meth:`trainer.model.SparseModel.dense_input`).

    With ``cfg.content`` the head holds the content encoder (``content``, :mod:`trainer.content`);
    joined as a ``field``, ``emb``'s last field is its output (``F`` = the slots + 1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.kind = cfg.kind
        self.bias = nn.Parameter(torch.zeros(1))
        field = cfg.content is not None and cfg.content.join == "field"
        nf, d, nd = len(cfg.slots) + field, cfg.embed_dim, len(cfg.dense_features)
        self.dense_linear = nn.Linear(nd, 1, bias=False) if nd else None
        #: a factor on each first-order field's pooled sum (``cfg.linear`` order; None without
        #: first-order fields), learned with ``cfg.linear_scale_lr`` (else held where it is: 1 in a
        #: new head). Why: a first-order weight per id fits whatever its few examples say; where a
        #: feature says nothing (thousands of values, each seen tens of times) those weights are
        #: noise and the served model ranked below counting clicks. The factor's gradient comes
        #: from examples scored *before* their ids' weights learned from them (progressive, in the
        #: sequential kernels), so it learns how far each field's weights hold on new examples and
        #: shrinks a field that says nothing (``make bench-worlds``, ``noise_feature``). It scales
        #: the field's term in the logit, not its rows' steps: a field whose factor fell (after a
        #: drift, say) relearns at its tables' own rate (``make bench-drift``). Every head
        #: with first-order fields holds it, learned or not, so a trainer and a serving replica
        #: whose configurations differ in this still score alike.
        self.linear_scale = (nn.Parameter(torch.ones(len(cfg.linear)), requires_grad=cfg.linear_scale_lr is not None)
                             if cfg.linear else None)
        if cfg.kind == "deepfm":
            layers: list[nn.Module] = []
            width = nf * d + nd
            for h in cfg.mlp:
                layers += [nn.Linear(width, h), nn.ReLU()]
                width = h
            layers.append(nn.Linear(width, 1))
            self.mlp = nn.Sequential(*layers)
        else:
            self.mlp = None
        # made after the MLP: a model without content draws the same initial head as before
        self.content = ContentEncoder(cfg.content, d) if cfg.content is not None else None
        self.scaler = DenseScaler(nd, cfg.dense_scaling) if nd and cfg.dense_scaling != "none" else None
        # labels (clicks, examples) seen before the bias started; None once it has (start_bias)
        self._unstarted: list[float] | None = [0.0, 0.0]
        self.register_load_state_dict_post_hook(_ask_again)
        self.register_load_state_dict_pre_hook(_factors_as_built)

    @property
    def bias_waits(self) -> bool:
        """Whether the bias still waits to start (:meth:`start_bias`): the same on replicas fed the
        same sums, so the N-rank engine asks it before a collective only a waiting head needs."""
        if self._unstarted is not None and float(self.bias.detach()[0]) != 0.0:  # learned or restored
            self._unstarted = None
        return self._unstarted is not None

    def start_bias(self, clicks: float | torch.Tensor, examples: float | torch.Tensor) -> bool:
        """Start a head that never learned at the log-odds of the labels: every engine calls this
        once per step with the step's global label sum and example count (numbers, or one-element
        tensors: read only while the bias waits to start), *before* the batch is scored where the
        engine knows them then (one process, the N-rank sync and hybrid steps; GBA's master at
        its first global batch, its ranks' replicas before then at their own labels), and calls
        :meth:`hold_bias` before its optimizer step. Returns whether the bias started in this call.

        Why: the bias starts at 0 (a click rate of one half) and the dense optimizer moves it about
        ``dense_lr`` per step (Adam's step hardly depends on the gradient's size), so on a stream
        whose clicks are rare it takes thousands of steps to get there, and meanwhile the
        first-order weights of the ids seen first absorb the offset, a wrong one for the ids seen
        later: the served model then ranked below counting clicks (``make bench-worlds``,
        ``docs/own-data.md`` section 6). Why before the batch is scored: a first batch scored and
        learned at a bias of 0 already does that harm, to the rows it holds (the most popular
        ones), whose Adagrad sums it also inflates for good; 100,000 impressions of 0.4% clicks
        ranked 0.70 / 0.63 / 0.63 (3 seeds) started before, against 0.68 / 0.60 / 0.62 after
        (``docs/own-data.md`` section 6). The batch's own labels then set the bias it is scored
        with: one number, once, the same for every example of the batch.

        A head counts as never learned while its bias is exactly 0 (as built, or loaded so): its
        bias then waits at 0 (no step) until it has seen a click and a non-click, and starts at
        the smoothed log-odds of everything seen so far, ``(clicks + 1/2) / (examples + 1)``. One
        whose bias is not 0 (restored, or learned) is left alone. Replicas fed the same global sums
        start equal.

        >>> from trainer.config import deepfm_config
        >>> h = DenseHead(deepfm_config("m", slots=("u",)))
        >>> h.start_bias(0, 1000), h.bias.item()    # no click yet: it waits
        (False, 0.0)
        >>> h.start_bias(3, 1000), round(h.bias.item(), 3)       # logit(3.5 / 2001)
        (True, -6.347)
        >>> _ = h.bias.data.fill_(0.25); h.load_state_dict(h.state_dict())   # a restored bias
        <All keys matched successfully>
        >>> h.start_bias(500, 1000), h.bias.item()
        (False, 0.25)
        """
        if not self.bias_waits:
            return False
        seen = self._unstarted
        assert seen is not None
        if not (math.isfinite(float(clicks)) and math.isfinite(float(examples))):  # (a label column missing)
            return False
        seen[0] += float(clicks)
        seen[1] += float(examples)
        if not 0.0 < seen[0] < seen[1]:
            return False
        p = (seen[0] + 0.5) / (seen[1] + 1.0)
        with torch.no_grad():
            self.bias.fill_(math.log(p / (1.0 - p)))
        self._unstarted = None
        log.info("the dense head's bias starts at %.4f: the log-odds of %g clicks in %g examples",
                 float(self.bias.detach()[0]), seen[0], seen[1])
        return True

    def hold_bias(self) -> None:
        """Before an optimizer step: a bias that still waits to start takes no step (it would stop
        being 0, and a 0 is how a head says it never learned)."""
        if self.bias_waits:
            self.bias.grad = None

    def scale_dense(self, dense: torch.Tensor | None) -> torch.Tensor | None:
        """The raw dense features ``[B, K]`` as the head takes them (:mod:`trainer.dense_scaling`)."""
        return dense if dense is None or self.scaler is None else self.scaler(dense)

    def stage_moments(self) -> None:
        """The last training forward's dense-feature moments as the scaler's gradients: every engine
        calls it before it reads or reduces the head's gradients (:mod:`trainer.dense_scaling`)."""
        if self.scaler is not None:
            self.scaler.stage()

    def forward(self, emb, lin, dense, fm: bool = True):
        """``fm=False`` leaves the FM term out (:mod:`ps.sequential_fm` computes it from fresh rows)."""
        out = self.bias.expand(_batch(emb, lin, dense))
        if lin is not None:
            out = out + lin.sum(1)
            if self.linear_scale is not None:  # the factors' value, the first-order rows' gradient unscaled (ps.sequential)
                out = out + (lin.detach() * (self.linear_scale - 1.0)).sum(1)
        if dense is not None and self.dense_linear is not None:
            out = out + self.dense_linear(dense).squeeze(1)
        if self.mlp is not None and emb is not None:
            x = emb.flatten(1)
            if dense is not None:
                x = torch.cat([x, dense], 1)
            if fm:
                s = emb.sum(1)
                out = out + 0.5 * (s * s - (emb * emb).sum(1)).sum(1)
            out = out + self.mlp(x).squeeze(1)
        return out

    def slopes(self, emb: torch.Tensor, dense: torch.Tensor | None) -> HeadSlopes:
        """A DeepFM head without its FM term, for :mod:`ps.sequential_fm`: the logits, each example's
        d logit / d field input, and :meth:`HeadSlopes.backward` for the head's gradients."""
        b, nf, d = emb.shape
        x = emb.flatten(1) if dense is None else torch.cat([emb.flatten(1), dense], 1)
        x = x.detach().requires_grad_(True)
        linears = [m for m in self.mlp if isinstance(m, nn.Linear)]  # Linear, ReLU, ..., Linear
        inputs, pre = [x], []
        for lin in linears[:-1]:
            pre.append(F.linear(inputs[-1], lin.weight.detach(), lin.bias.detach()))
            inputs.append(torch.relu(pre[-1]))
        out = F.linear(inputs[-1], linears[-1].weight.detach(), linears[-1].bias.detach()).squeeze(1)
        # logit e depends on x[e] alone: the gradient of the sum is every example's own slope
        jac, *deltas = torch.autograd.grad(out.sum(), [x, *pre])
        with torch.no_grad():
            logits = out + self.bias
            if dense is not None and self.dense_linear is not None:
                logits = logits + self.dense_linear(dense).squeeze(1)
        return HeadSlopes(self, logits, jac[:, :nf * d].reshape(b, nf, d).cpu().numpy(), dense,
                          [a.detach() for a in inputs], deltas)


@dataclasses.dataclass
class HeadSlopes:
    """What :meth:`DenseHead.slopes` computed: ``logits`` ``[B]`` (no graph), ``jac`` float32
    ``[B, F, D]``, and per MLP layer its input and its pre-activation gradient at seed 1.

    The backward pass is linear in its seed, so the one that gave ``jac`` gives every weight's
    gradient for any seed too: a layer's is ``(seed * delta)^T @ input``. The MLP is not run
    backward a second time once the residuals are known."""

    head: DenseHead
    logits: torch.Tensor
    jac: np.ndarray
    dense: torch.Tensor | None
    inputs: list[torch.Tensor]
    deltas: list[torch.Tensor]

    def backward(self, seed: torch.Tensor) -> None:
        """Set every head parameter's ``.grad`` to d sum(seed * logits) / d parameter."""
        head, r = self.head, seed.reshape(-1, 1)
        linears = [m for m in head.mlp if isinstance(m, nn.Linear)]
        for lin, a, delta in zip(linears[:-1], self.inputs[:-1], self.deltas):
            rd = delta * r
            lin.weight.grad = rd.t() @ a
            lin.bias.grad = rd.sum(0)
        linears[-1].weight.grad = r.t() @ self.inputs[-1]
        linears[-1].bias.grad = r.sum(0)
        head.bias.grad = r.sum(0)
        if self.dense is not None and head.dense_linear is not None:
            head.dense_linear.weight.grad = r.t() @ self.dense


def _ask_again(head: DenseHead, incompatible) -> None:
    """After a load: whether the bias starts is decided again from what was loaded."""
    head._unstarted = [0.0, 0.0]


def _factors_as_built(head: DenseHead, state: dict, prefix: str, *args) -> None:
    """A state saved before heads held first-order factors, or with other first-order fields: the
    factors start at 1 (a state that has them where the head has no first-order field: left out)."""
    key = prefix + "linear_scale"
    if head.linear_scale is None:
        state.pop(key, None)
    elif key not in state or state[key].shape != head.linear_scale.shape:
        if key in state:
            log.warning("the first-order fields changed since this head was saved: their factors start at 1")
        state[key] = torch.ones_like(head.linear_scale.detach())


def _batch(*xs):
    for x in xs:
        if x is not None:
            return x.shape[0]
    raise ValueError("no input")


def make_dense_optimizer(cfg: ModelConfig, head: nn.Module) -> torch.optim.Optimizer:
    """The dense optimizer; torch's fused CPU kernel where it has one (one kernel per step, not
    one per parameter tensor: ~3x cheaper for the DeepFM head). Its step merges the dense scaler's
    moments first (:mod:`trainer.dense_scaling`)."""
    cls = optimizer_class({"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad,
                           "sgd": torch.optim.SGD}[cfg.dense_optimizer])
    params: list = list(head.parameters())
    groups = []  # parameters at their own rate
    content = getattr(head, "content", None)
    if content is not None and cfg.content is not None and cfg.content.lr is not None:
        groups.append({"params": list(content.parameters()), "lr": cfg.content.lr})
    if getattr(head, "linear_scale", None) is not None:  # rate 0 without one: held, whatever gradient the N-rank sum sets
        groups.append({"params": [head.linear_scale], "lr": cfg.linear_scale_lr or 0.0, "name": FACTORS})
    if groups:
        own = {id(p) for g in groups for p in g["params"]}
        params = [{"params": [p for p in params if id(p) not in own]}, *groups]
    try:
        opt = cls(params, lr=cfg.dense_lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        opt = cls(params, lr=cfg.dense_lr)
    opt.register_step_pre_hook(merge_moments_before_step(head))  # the dense scaler's statistics
    return opt


def load_dense_optimizer(opt: torch.optim.Optimizer, saved: dict, head: DenseHead) -> None:
    """Load a saved state of :func:`make_dense_optimizer`'s optimizer of ``head`` into ``opt``,
    parameter by parameter, keeping ``opt``'s own groups and settings.

    The saved state (Adam's moments and step counts) comes back; every group's rate and other
    settings stay the ones ``opt`` was made with, the configuration's (torch's ``load_state_dict``
    would put the saved ones back, so a ``dense_lr`` changed in the project file would be ignored
    at every restart; the tables' optimizers follow the configuration too:
    :func:`ps.snapshot.load_shard`). The groups may differ from the saved ones: a content encoder's
    own rate (``content.lr``) set or unset since, or first-order factors
    (:attr:`DenseHead.linear_scale`) the saved head did not have (they start fresh, as a parameter
    whose saved state has another shape does). The state of another kind of optimizer
    (``dense_optimizer`` changed since: Adam's moments mean nothing to Adagrad) or one whose
    parameters cannot be matched (another head: :func:`trainer.snapshot_store.restore_blockers`
    refuses those before) leaves the optimizer fresh, with a warning; the head's weights and the
    tables are restored all the same.

    >>> from trainer.config import deepfm_config
    >>> cfg = deepfm_config("m", slots=("u",))
    >>> head = DenseHead(cfg)
    >>> opt = make_dense_optimizer(cfg, head)
    >>> older = {**opt.state_dict(), "param_groups": opt.state_dict()["param_groups"][:1]}
    >>> load_dense_optimizer(opt, older, head); [g["lr"] for g in opt.param_groups]
    [0.001, 0.01]
    >>> faster = make_dense_optimizer(cfg.model_copy(update={"dense_lr": 0.005}), head)
    >>> load_dense_optimizer(faster, opt.state_dict(), head); [g["lr"] for g in faster.param_groups]
    [0.005, 0.01]
    >>> adagrad = make_dense_optimizer(cfg.model_copy(update={"dense_optimizer": "adagrad"}), head)
    >>> load_dense_optimizer(adagrad, opt.state_dict(), head); sorted(adagrad.state_dict()["state"][0])
    ['step', 'sum']
    """
    groups, state = saved.get("param_groups", []), saved.get("state", {})
    now = opt.state_dict()
    kind, saved_kind = _optimizer_kind(now["param_groups"][0]), _optimizer_kind(groups[0]) if groups else None
    if groups and saved_kind != kind:
        log.warning("the dense optimizer is %s, the snapshot's was %s: it starts fresh (the head's weights and "
                    "the tables are restored)", kind, saved_kind)
        return
    factors = [head.linear_scale] if head.linear_scale is not None else []
    content = list(head.content.parameters()) if head.content is not None else []
    had_factors = bool(groups) and groups[-1].get("name") == FACTORS
    had_content = len(groups) - had_factors == 2
    own = {id(p) for p in [*factors, *(content if had_content else [])]}
    # the saved indices' parameters, in make_dense_optimizer's order for the saved configuration
    order: list = [p for p in head.parameters() if id(p) not in own]
    order += (content if had_content else []) + (factors or [None] if had_factors else [])
    saved_n = sum(len(g["params"]) for g in groups)
    if len(order) != saved_n:
        log.warning("the dense optimizer's saved state does not fit this head (%d parameters saved, %d now): "
                    "it starts fresh", saved_n, len(order))
        return
    by_param = {}
    for i, p in enumerate(order):
        got = state.get(i)
        if p is None or got is None:
            continue
        if any(torch.is_tensor(v) and v.dim() and v.shape != p.shape for v in got.values()):
            log.warning("the first-order fields changed since this head was saved: their optimizer state starts fresh")
            continue
        by_param[id(p)] = got
    rates, saved_rates = [g["lr"] for g in now["param_groups"]], [g.get("lr") for g in groups]
    if rates != saved_rates:  # (an operator who edited a rate sees it taken)
        log.info("the dense optimizer learns on at the configuration's rates %s (the snapshot's: %s)", rates, saved_rates)
    flat = [p for g in opt.param_groups for p in g["params"]]
    opt.load_state_dict({"state": {i: by_param[id(p)] for i, p in enumerate(flat) if id(p) in by_param},
                         "param_groups": now["param_groups"]})


#: a setting only one kind of dense optimizer's parameter groups hold: which kind saved a state
_KIND_BY_GROUP_KEY = {"betas": "adam", "lr_decay": "adagrad", "dampening": "sgd"}


def _optimizer_kind(group: dict) -> str | None:
    """The ``dense_optimizer`` a parameter group (a state dict's) belongs to; None if none of ours."""
    return next((kind for key, kind in _KIND_BY_GROUP_KEY.items() if key in group), None)


def load_optimizer_state(opt: torch.optim.Optimizer, saved: dict) -> None:
    """``opt.load_state_dict(saved)`` with every group's settings (rate, betas, ...) kept as ``opt``
    was made: a snapshot brings back what was learned, the configuration says how to learn on."""
    made = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    opt.load_state_dict(saved)
    for g, settings in zip(opt.param_groups, made):
        g.update(settings)
