"""Activation memory: what autograd keeps from forward for backward, and activation
checkpointing (chapter 7).

Two measures, one per question:

* :func:`measure_saved` asks autograd itself. ``torch.autograd.graph.saved_tensors_hooks``
  calls a pack hook for every tensor an operator saves for its backward; module hooks say
  which module was running then, and a ``TorchFunctionMode`` which torch function
  (``layer_norm``, ``linear``, ``matmul``, ...). It lists every saved tensor
  (:class:`SavedTensor`) and counts each storage once, at the storage's size: a view, or the
  same tensor saved by a second operator, adds nothing. Not counted: parameters and buffers
  (their storage is the model's, held with or without a forward pass) and the batch handed to
  the model (the data loader's); both still appear in the list, marked as such.
* :func:`measure_alive` asks the allocator's side: the storages that operators made during
  the forward pass (loss included) and that are still alive when it returns, per layer that
  made them (:class:`labs.memory.AllocationTracker`, one per layer call). The loss itself is
  the caller's and is reported apart. This measure does not depend on how anything keeps a
  tensor, which matters for activation checkpointing: non-reentrant
  ``torch.utils.checkpoint`` installs its own saved-tensor hooks inside the checkpointed
  region, so the pack hook above never sees what is saved in there (it is dropped and
  recomputed); the region's *inputs* it keeps for the recomputation, and it saves those
  outside its own hooks (as the saved tensors of a no-op autograd Function, or of its
  frame, depending on the torch version), so the pack hook does see them.

Without checkpointing both measures give the same total: what is alive after forward is what
autograd saved, nothing else; with checkpointing of every block they agree too (the tests
check both). Per layer they differ by attribution: a tensor is
*saved by* the layer that uses it (a block's input by its first LayerNorm, the position ids by
``pos_emb``) but *made in* the layer before (the previous block, the model's own forward).

Not counted by either: the CPU random-number state that ``checkpoint`` stashes per call
(``torch.get_rng_state()``, a few KiB, built outside the dispatcher, so the tracker cannot
see it), memory an operator uses and frees inside itself, and the allocator's reserve.

The closed form of the chapter's transformer (:func:`activation_bytes`) and MLP
(:func:`mlp_activation_bytes`) is derived op by op below; both measures equal it exactly.
The chapter's models and the checkpointing measurement are in
:mod:`labs.experiments.activations`.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from labs.memory import AllocationTracker


def checkpoint_module(module: nn.Module) -> Callable[[], None]:
    """Make ``module``'s forward an activation checkpoint (non-reentrant
    ``torch.utils.checkpoint``): its forward keeps only its inputs for backward, and backward
    runs the forward again to rebuild what it needs. Hooks registered on ``module`` still fire
    once per call (they run around ``module.forward``, outside the checkpoint), and not during
    the recomputation. Returns a function that undoes it."""
    plain = module.forward
    module.forward = functools.partial(checkpoint, plain, use_reentrant=False)

    def undo() -> None:
        del module.forward  # the instance attribute: the class's forward shows again

    return undo


# --- records -----------------------------------------------------------------------------------

#: The layer name of operations that run in the model's own ``forward``, outside every listed
#: layer (the transformer's ``tok_emb(ids) + pos_emb(positions)``).
MODEL = "(model)"
#: The layer name of operations of the workload's loss, outside the model.
LOSS = "(loss)"


class ActivationMeasure(enum.Enum):
    """How an :class:`ActivationReport` was measured."""

    #: saved-tensor hooks: each storage autograd saves, counted for the layer that saves it
    SAVED = "saved for backward"
    #: allocation trackers: each storage made during forward and alive when it returns,
    #: counted for the layer that made it (sees activation checkpointing too)
    ALIVE = "alive after forward"


class SavedKind(enum.Enum):
    """What a saved tensor's storage is, and so whether it is counted."""

    ACTIVATION = "activation"  #: made by forward, saved here first: counted
    REPEAT = "repeat"  #: a storage counted already (a view of it, or saved by a second op)
    PARAMETER = "parameter"  #: a parameter's or buffer's storage: the model's, not counted
    BATCH = "batch"  #: a storage of the batch handed to the model: the loader's, not counted


@dataclass(frozen=True)
class SavedTensor:
    """One tensor that autograd saved for backward, in the order they were saved."""

    layer: str  #: the listed layer it is counted for (or MODEL, LOSS)
    module: str  #: the innermost module running, e.g. ``"blocks.0.attn.qkv"``
    #: the torch function that saved it, e.g. ``"layer_norm"``; ``"-"`` when none ran (as
    #: when a checkpoint saves its region's inputs)
    op: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int  #: numel x element size: the bytes this tensor (maybe a view) spans
    storage_bytes: int  #: the size of the storage behind it
    kind: SavedKind

    @property
    def counted_bytes(self) -> int:
        """What it adds to the total: its storage's size if it is a new activation, else 0."""
        return self.storage_bytes if self.kind is SavedKind.ACTIVATION else 0


@dataclass(frozen=True)
class LayerActivations:
    """The activation bytes of one layer."""

    name: str
    nbytes: int
    #: storages counted (ActivationMeasure.SAVED); None for ALIVE (the tracker counts bytes)
    tensors: int | None


@dataclass(frozen=True)
class ActivationReport:
    """Activation bytes per layer of one forward pass; :attr:`total_bytes` is their sum."""

    measure: ActivationMeasure
    #: MODEL first, then the workload's layers in its order, then LOSS
    layers: tuple[LayerActivations, ...]
    output_bytes: int  #: the loss the forward returned: the caller's, not in the total
    #: every tensor saved for backward, in order (ActivationMeasure.SAVED only)
    saved: tuple[SavedTensor, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def bytes_by_layer(self) -> dict[str, int]:
        return {layer.name: layer.nbytes for layer in self.layers}

    def saved_in(self, prefix: str) -> tuple[SavedTensor, ...]:
        """The saved tensors of module ``prefix`` and its children (``"blocks.0"``: one
        block's list)."""
        return tuple(s for s in self.saved if _within(s.module, prefix))


# --- what runs: model, batch, loss ---------------------------------------------------------------


def default_layers(model: nn.Module) -> tuple[str, ...]:
    """The model's children, with a ``Sequential``/``ModuleList`` child (or root) opened into
    its children: ``tok_emb, pos_emb, blocks.0, ..., ln_f, head`` for the transformer,
    ``0, 1, ...`` for the MLP."""
    containers = (nn.Sequential, nn.ModuleList)
    if isinstance(model, containers):
        return tuple(name for name, _ in model.named_children())
    out: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, containers) and len(child):
            out += [f"{name}.{sub}" for sub, _ in child.named_children()]
        else:
            out.append(name)
    return tuple(out)


@dataclass(frozen=True)
class Workload:
    """A model, its batch and its loss: ``loss(model, *batch)`` is the forward pass measured.

    ``layers`` (default :func:`default_layers`) are the modules the report has a line for;
    none may sit inside another, because a storage is counted for one layer only.
    """

    model: nn.Module
    batch: tuple[torch.Tensor, ...]
    loss: Callable[..., torch.Tensor]
    layers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not all(isinstance(t, torch.Tensor) for t in self.batch):
            raise TypeError("batch must be a tuple of tensors, e.g. (ids, targets).")
        if not self.layers:
            object.__setattr__(self, "layers", default_layers(self.model))
        known = {name for name, _ in self.model.named_modules()} - {""}
        for name in self.layers:
            if name not in known:
                raise ValueError(f"layer {name!r} is not a module of the model; give names "
                                 f"from model.named_modules(), e.g. {sorted(known)[:4]}.")
        for a, b in itertools.permutations(self.layers, 2):
            if _within(a, b):
                raise ValueError(f"layer {a!r} is inside layer {b!r}: list one of them, so "
                                 "that every storage is counted for one layer.")

    def forward(self) -> torch.Tensor:
        """Run the forward pass and the loss once."""
        return self.loss(self.model, *self.batch)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _layer_of(module: str | None, layers: Sequence[str]) -> str:
    """The listed layer that ``module`` (None: outside the model; "": the root) runs in."""
    if module is None:
        return LOSS
    for layer in layers:
        if _within(module, layer):
            return layer
    return MODEL


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata  # the StorageImpl's address: one per storage


@contextlib.contextmanager
def _module_hooks(model: nn.Module, names: Sequence[str],
                  enter: Callable[[str], None], leave: Callable[[str], None]) -> Iterator[None]:
    """Call ``enter(name)`` before and ``leave(name)`` after each call of the named modules
    ("" is the root) while the block runs; ``leave`` runs even when forward raises."""
    def pre_hook(name: str) -> Callable[..., None]:
        return lambda _module, _args: enter(name)

    def post_hook(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: object, _output: object) -> None:
            leave(name)  # and return None: a forward hook's return value replaces the output

        return hook

    handles = []
    try:
        for name in names:
            module = model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(pre_hook(name)))
            handles.append(module.register_forward_hook(post_hook(name), always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


class _FunctionNames(TorchFunctionMode):
    """Keeps the name of the torch function running now (the outermost one: the mode is off
    inside its own handler, so ``F.layer_norm`` is seen and the ``torch.layer_norm`` it calls
    is not)."""

    def __init__(self) -> None:
        super().__init__()
        self.running: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict | None = None) -> Any:
        self.running.append(getattr(func, "__name__", str(func)).strip("_"))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.running.pop()


# --- the two measures ----------------------------------------------------------------------------


def measure_saved(workload: Workload) -> ActivationReport:
    """What autograd saves for backward in one ``workload.forward()``, per layer.

    Every saved tensor is listed; its storage is counted once (the first time it is saved),
    at the storage's full size, unless it belongs to a parameter, a buffer or the batch. Cost:
    a little Python per torch function call and per saved tensor, and the graph is kept alive
    until the report is made (the saved tensors must not be freed while counted: a freed
    storage's address could be reused by a new one).

    Inside a non-reentrant checkpoint nothing is seen (the checkpoint's own hooks take over
    there); its inputs are (see the module's docstring). :func:`measure_alive` compares with
    and without checkpointing without relying on how checkpoint keeps them.
    """
    model = workload.model
    own = {_key(t) for t in itertools.chain(model.parameters(), model.buffers())}
    batch = {_key(t) for t in workload.batch}
    names = {name for name, _ in model.named_modules()}  # "" included: the root
    running: list[str] = []
    functions = _FunctionNames()
    seen: set[int] = set()
    saved: list[SavedTensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _key(tensor)
        if key in own:
            kind = SavedKind.PARAMETER
        elif key in batch:
            kind = SavedKind.BATCH
        elif key in seen:
            kind = SavedKind.REPEAT
        else:
            kind = SavedKind.ACTIVATION
            seen.add(key)
        module = running[-1] if running else None
        saved.append(SavedTensor(
            _layer_of(module, workload.layers), LOSS if module is None else module or MODEL,
            functions.running[-1] if functions.running else "-", tuple(tensor.shape),
            str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size(),
            tensor.untyped_storage().nbytes(), kind))
        return tensor  # autograd keeps what it always keeps: the measure changes nothing

    with (_module_hooks(model, sorted(names), running.append, lambda _name: running.pop()),
          functions, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
        loss = workload.forward()
    counts: dict[str, list[int]] = {n: [0, 0] for n in (MODEL, *workload.layers, LOSS)}
    for s in saved:
        if s.kind is SavedKind.ACTIVATION:
            counts[s.layer][0] += s.storage_bytes
            counts[s.layer][1] += 1
    layers = tuple(LayerActivations(n, nbytes, k) for n, (nbytes, k) in counts.items())
    return ActivationReport(ActivationMeasure.SAVED, layers, loss.untyped_storage().nbytes(),
                            tuple(saved))


def measure_alive(workload: Workload) -> ActivationReport:
    """The storages made during one ``workload.forward()`` that are still alive when it
    returns, per layer that made them, the returned loss apart.

    One :class:`~labs.memory.AllocationTracker` runs around the whole forward and loss,
    another around the model's call, and one around each call of each listed layer (entered
    and left by module hooks, so they nest like the calls). A layer's bytes are its trackers'
    live bytes; MODEL is the model's tracker minus its layers', LOSS the whole minus the
    model's. Alive means held by something: autograd's saved tensors, a checkpoint's inputs
    (what this measure is for), or anything else (a module that caches a tensor would count).
    Cost: a little Python per operator per open tracker.
    """
    model = workload.model
    trackers: dict[str, list[AllocationTracker]] = {n: [] for n in ("", *workload.layers)}
    open_: dict[str, list[AllocationTracker]] = {n: [] for n in trackers}

    def enter(name: str) -> None:
        tracker = AllocationTracker()
        tracker.__enter__()
        trackers[name].append(tracker)
        open_[name].append(tracker)

    def leave(name: str) -> None:
        open_[name].pop().__exit__(None, None, None)

    with _module_hooks(model, list(trackers), enter, leave), AllocationTracker() as whole:
        loss = workload.forward()
    everything = [whole, *itertools.chain.from_iterable(trackers.values())]
    for tracker in everything:
        tracker.untrack([loss])
    live = {name: sum(t.live_bytes for t in ts) for name, ts in trackers.items()}
    in_layers = sum(live[n] for n in workload.layers)
    per_layer = {MODEL: live[""] - in_layers, **{n: live[n] for n in workload.layers},
                 LOSS: whole.live_bytes - live[""]}
    layers = tuple(LayerActivations(n, b, None) for n, b in per_layer.items())
    return ActivationReport(ActivationMeasure.ALIVE, layers, loss.untyped_storage().nbytes())


def gradients(workload: Workload) -> dict[str, torch.Tensor]:
    """One forward and backward from zero gradients: each trainable parameter's gradient, by
    name (a tied parameter once, under its first name)."""
    workload.model.zero_grad(set_to_none=True)
    workload.forward().backward()
    return {name: p.grad.detach().clone() for name, p in workload.model.named_parameters()
            if p.grad is not None}


def recomputed_modules(workload: Workload) -> tuple[str, ...]:
    """The modules whose forward runs *during backward*, in order: none without
    checkpointing; with it, every module inside each checkpointed block, once per block
    (the checkpointed block itself is not listed: its hooks run outside the checkpoint)."""
    model = workload.model
    in_backward: list[bool] = [False]
    ran: list[str] = []

    def enter(name: str) -> None:
        if in_backward[0]:
            ran.append(name)

    names = [name for name, _ in model.named_modules()]
    with _module_hooks(model, names, enter, lambda _name: None):
        model.zero_grad(set_to_none=True)
        loss = workload.forward()
        in_backward[0] = True
        loss.backward()
    return tuple(ran)


# --- the closed form -----------------------------------------------------------------------------


def check_positive(**values: object) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive whole number, got {value!r}.")


def activation_bytes(batch: int, seq_len: int, d_model: int, n_heads: int, n_layers: int,
                     vocab: int, *, element_size: int = 4, checkpointing: bool = False,
                     device_type: str = "cpu") -> int:
    """Bytes of activations that one forward pass of :class:`labs.train.TinyTransformer`
    (and its cross-entropy loss) leaves for backward: the closed form of both measures.

    B = batch, T = seq_len, D = d_model, H = n_heads, L = n_layers, V = vocab,
    e = element_size (4 for fp32, 2 for bf16). One ``labs.train.Block`` saves, per token
    (B·T of them), in elements of e bytes:

    ============================  ====================================================  =====
    op                            saves                                                 per token
    ============================  ====================================================  =====
    ln1 = LayerNorm(x)            its input x, mean and rstd (one each per token)       D + 2
    attn.qkv = Linear(D, 3D)      its input, ln1(x)                                     D
    q @ kᵀ (matmul)               copies of q and k: their head-split views are not     2D
                                  contiguous, so matmul's reshape to (B·H, T, D/H)
                                  copies them, and bmm saves the copies
    / sqrt(D/H)                   nothing (a constant)                                  0
    masked_fill(future, -inf)     the T x T bool mask: T² bytes per block, whatever B   -
    softmax                       its output, (B, H, T, T): H·T per token               H·T
    weights @ v (matmul)          the softmax output again (a view: counted once) and   D
                                  a copy of v
    attn.proj = Linear(D, D)      its input, the heads put back together (a copy)       D
    x + attn(...)                 nothing                                               0
    ln2 = LayerNorm(x)            input, mean, rstd                                     D + 2
    mlp.0 = Linear(D, 4D)         its input, ln2(x)                                     D
    mlp.1 = GELU                  its input                                             4D
    mlp.2 = Linear(4D, D)         its input, GELU's output                              4D
    x + mlp(...)                  nothing                                               0
    ============================  ====================================================  =====

    so a block keeps B·T·(16·D + H·T + 4)·e + T² bytes: a width part (16 D), an attention
    part (H T: the scores grow with the sequence) and the LayerNorm statistics (4). A block's
    output is the next block's input, saved there, so nothing is counted twice. Outside the
    blocks: ``tok_emb`` saves the ids (the batch: not counted); ``pos_emb`` saves the
    positions ``arange(T)``, 8·T bytes (int64); ``ln_f`` its input, mean and rstd (D + 2 per
    token); the tied ``head`` its input (D); the loss, ``log_softmax`` then ``nll_loss``,
    saves the log-probabilities (V per token; nll_loss saves them again: the same storage),
    the targets (the batch) and a one-element total weight (e bytes). In all::

        B·T·L·(16·D + H·T + 4)·e + L·T² + 8·T + B·T·(2·D + 2 + V)·e + e

    With ``checkpointing`` (every block a checkpoint) a block keeps only its input, B·T·D·e,
    in the checkpoint's closure: B·T·L·D·e + 8·T + B·T·(2·D + 2 + V)·e + e (the RNG state
    that checkpoint stashes per block is not in it: see the module's docstring).
    Parameters are not activations: the tied head weight is the model's storage.

    ``device_type="cuda"``: CUDA's LayerNorm kernel keeps its mean and rstd in float32 (its
    accumulation type) whatever the compute dtype, so each of the statistics terms above
    (4 per token per block, 2 for ``ln_f``) counts s = max(e, 4) bytes instead of e: in bf16,
    4·(4·L + 2) bytes more per token than on the CPU, whose kernel keeps them in bf16.
    """
    check_positive(batch=batch, seq_len=seq_len, d_model=d_model, n_heads=n_heads,
                    n_layers=n_layers, vocab=vocab)
    if d_model % n_heads:
        raise ValueError(f"d_model={d_model} must divide into n_heads={n_heads} heads of equal "
                         "size: pick a multiple of n_heads.")
    if isinstance(element_size, bool) or element_size not in (1, 2, 4, 8):
        raise ValueError(f"element_size must be the bytes of one element, 1, 2, 4 or 8 (4 for "
                         f"fp32, 2 for bf16), got {element_size!r}.")
    if not isinstance(checkpointing, bool):
        raise ValueError(f"checkpointing must be True or False, got {checkpointing!r}.")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}.")
    tokens, e = batch * seq_len, element_size
    stats = max(e, 4) if device_type == "cuda" else e  # bytes of one LayerNorm mean or rstd
    outside = 8 * seq_len + tokens * ((2 * d_model + vocab) * e + 2 * stats) + e
    if checkpointing:
        return tokens * n_layers * d_model * e + outside
    per_block = tokens * ((16 * d_model + n_heads * seq_len) * e + 4 * stats) + seq_len ** 2
    return n_layers * per_block + outside


def mlp_activation_bytes(batch: int, width: int, layers: int, *, element_size: int = 4) -> int:
    """Bytes the chapter-5/6 MLP (:func:`labs.models.mlp`: ``layers`` x (Linear(W, W),
    ReLU)) and its loss ``out.square().mean()`` leave for backward: B·W·L·e.

    Each Linear saves its input; each ReLU saves its output, which is the next Linear's input
    (the same storage, counted once); ``square`` saves the last ReLU's output again; ``mean``
    saves nothing. The first Linear's input is the batch (not counted), so what is left is one
    (B, W) tensor per layer, the ReLU's output.
    """
    check_positive(batch=batch, width=width, layers=layers)
    if isinstance(element_size, bool) or element_size not in (1, 2, 4, 8):
        raise ValueError(f"element_size must be 1, 2, 4 or 8 bytes, got {element_size!r}.")
    return batch * width * layers * element_size
