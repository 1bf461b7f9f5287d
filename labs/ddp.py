"""Chapter 5: data parallelism by hand, the naive way and then the way PyTorch DDP does it.

Every rank holds the whole model and its own slice of the batch. After ``loss.backward()``
each rank's gradients come from its own samples; averaging them over the N ranks gives the
gradient of the mean loss over all samples, provided every rank's local batch has the same
size (chapter 1). Both wrappers below make that average, and both are used the same way:

    model = DDP(net)                          # or NaiveDDP(net)
    loss = loss_fn(model(x), y)
    loss.backward()
    model.finish_gradient_synchronization()   # every p.grad now holds the average
    optimizer.step()

Cost per step, whichever wrapper: each rank sends 2(N-1)/N * S bytes, S being the bytes of
all trainable gradients (a ring all-reduce, chapter 2). What differs is the number of
messages and when they are sent:

* :class:`NaiveDDP` waits for backward to end, then all-reduces each gradient on its own:
  one collective per parameter (each pays the latency alpha), none overlapping backward.
* :class:`DDP` packs gradients into flat buckets of about ``bucket_cap_mb``, in reverse
  registration order (roughly the order backward produces them), and launches a bucket's
  all-reduce asynchronously the moment its last gradient is ready, so communication runs
  while backward computes the gradients of earlier layers.

Where the gradients travel depends on the launch. On the real transport both wrappers call
torch's ``dist.all_reduce``. When the launch has an emulated network
(``launch(..., link=labs.Link(alpha, bandwidth))``, :mod:`labs.link`), which carries only labs'
own point-to-point messages, both all-reduce with labs' lock-step ring instead
(:func:`all_reduce_sum`), and :class:`DDP` hands each full bucket to a background thread
(:class:`CommStream`) so that the emulated transfers run while backward computes.

The names follow ``torch.nn.parallel.DistributedDataParallel``: ``.module``, ``no_sync()``,
``bucket_cap_mb``, ``find_unused_parameters``, ``broadcast_buffers``.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labs import link
from labs.clock import DeviceClock, Moment, seconds
from labs.collectives import ring_all_reduce
from labs.comm_stream import CommStream
from labs.ddp_join import JoinMixin

#: torch DDP's default bucket size, in MiB.
DEFAULT_BUCKET_CAP_MB = 25.0
_MIB = 1024 * 1024
#: Attribute a parameter carries while a :class:`DDP` has hooked it.
_OWNER = "_labs_ddp_hooked"


def broadcast_state(module: nn.Module, group: dist.ProcessGroup | None = None, src: int = 0
                    ) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s (in place).

    Ranks may have built their models from different seeds; after this they start from the
    same point, which the averaging of gradients then keeps them at. One broadcast per tensor
    (S bytes from the source, a tree or ring inside the backend)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=dist.get_global_rank(group, src) if group else src,
                           group=group)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Sum ``tensor`` over the ranks of ``group``, in place, and return when it is done.

    On the real transport this is torch's ``dist.all_reduce``. When the launch has an
    emulated link (:func:`labs.link.active`), torch's collectives would bypass it, so this runs
    labs' lock-step ring (:func:`labs.collectives.ring_all_reduce`, one message per ring step):
    2(N-1) messages of S/N bytes one after the other, 2(N-1)(alpha + S / (N bandwidth))
    seconds on the link, at N = 2 two messages, 2 alpha + S / bandwidth."""
    if link.active() is not None:
        ring_all_reduce(tensor, group=group, segment_bytes=None)
    else:
        dist.all_reduce(tensor, group=group)


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter that needs a gradient, in registration order,
    each shared (tied) parameter once, under the first name it was registered with."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


class _SyncMixin:
    """``no_sync()`` for both wrappers: the flag that gradient synchronisation reads."""

    require_backward_grad_sync: bool

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside the block (and their
        ``finish_gradient_synchronization()``) send nothing. The first backward after the
        block synchronises the sum of everything accumulated, so k micro-batches cost one
        all-reduce instead of k. Put forward *and* backward inside the block."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous


class NaiveDDP(_SyncMixin, nn.Module):
    """Data parallelism in its plainest form: after backward, all-reduce every gradient.

    At construction the parameters and buffers of rank 0 are broadcast to every rank.
    :meth:`finish_gradient_synchronization` then sums each trainable parameter's gradient
    over the ranks (:func:`all_reduce_sum`) and divides by N: ``len(parameters)`` blocking
    all-reduces per step, started only after backward has finished. ``timeline`` records
    when each one started and ended (keyed by the parameter's index in
    :func:`trainable_parameters`), stamped by ``clock`` (on a GPU, when the GPU got there).
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None
                 ) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.require_backward_grad_sync = True
        self.timeline = StepTimeline()
        self.clock = DeviceClock.of(module)
        broadcast_state(module, process_group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Average every trainable gradient over the ranks (nothing inside ``no_sync()``).

        Every rank must all-reduce the same tensors in the same order, so a trainable
        parameter without a gradient on this rank is an error here, named, rather than a
        hang in a peer."""
        if not self.require_backward_grad_sync:
            return
        world_size = dist.get_world_size(self.process_group)
        missing = [name for name, p in trainable_parameters(self.module) if p.grad is None]
        if missing:
            raise RuntimeError(
                f"NaiveDDP: parameter(s) {missing} got no gradient in this backward pass, so "
                "this rank cannot all-reduce the same gradients as the others. Use every "
                "parameter in forward, freeze it (requires_grad=False), or use "
                "DDP(..., find_unused_parameters=True).")
        for index, (_, param) in enumerate(trainable_parameters(self.module)):
            self.timeline.launched[index] = self.clock.stamp()
            # blocks until every rank's is in (on NCCL: the stream waits for it)
            all_reduce_sum(param.grad, self.process_group)
            self.timeline.done[index] = self.clock.stamp()
            param.grad /= world_size


# --- bucketed, overlapped DDP ------------------------------------------------------------------


class BucketState(enum.Enum):
    """Where a bucket is in the current backward pass."""

    FILLING = "filling"
    """Waiting for some of its gradients."""
    READY = "ready"
    """Every gradient copied in; waiting for the buckets before it to be launched (all ranks
    must launch their all-reduces in the same order)."""
    LAUNCHED = "launched"
    """Its asynchronous all-reduce is in flight."""


@dataclass
class Bucket:
    """A flat gradient buffer for a few parameters, all-reduced as one message."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    """Where each parameter's gradient starts in ``buffer`` (elements)."""
    buffer: torch.Tensor
    """1-D, numel = sum of the parameters' numels, the parameters' dtype and device."""
    state: BucketState = BucketState.FILLING
    arrived: set[int] = field(default_factory=set)
    """Positions (in ``params``) whose gradient has been copied into ``buffer``."""
    work: Any = None
    """The all-reduce's ``dist.Work`` (or, on an emulated link, its :class:`CommStream`
    future) while LAUNCHED."""

    def slot(self, position: int) -> torch.Tensor:
        """The part of ``buffer`` that holds ``params[position]``'s gradient (a view)."""
        param = self.params[position]
        start = self.offsets[position]
        return self.buffer[start:start + param.numel()].view_as(param)


def assign_buckets(params: list[tuple[str, nn.Parameter]], bucket_cap_mb: float
                   ) -> list[list[tuple[str, nn.Parameter]]]:
    """Split parameters into buckets, as torch DDP does: walk them in *reverse* registration
    order (backward produces the last layer's gradients first), add each to the open bucket
    of its dtype and device, and close that bucket once it holds ``bucket_cap_mb`` MiB or
    more. A parameter larger than the cap gets a bucket of its own; a tiny cap gives one
    parameter per bucket. (torch 2.13 makes its first bucket 1 MiB when ``bucket_cap_mb`` is
    left at its default; this does not.)"""
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive (MiB), got {bucket_cap_mb!r}; "
                         f"torch's default is {DEFAULT_BUCKET_CAP_MB}.")
    cap = bucket_cap_mb * _MIB
    closed: list[list[tuple[str, nn.Parameter]]] = []
    open_: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
    for name, param in reversed(params):
        key = (param.dtype, param.device)
        bucket = open_.setdefault(key, [])
        bucket.append((name, param))
        if sum(p.numel() * p.element_size() for _, p in bucket) >= cap:
            closed.append(open_.pop(key))
    closed.extend(b for b in open_.values() if b)
    return closed


@dataclass
class StepTimeline:
    """The moments of one backward pass under :class:`DDP` (or :class:`NaiveDDP`, whose every
    parameter is a bucket of its own), stamped by the wrapper's
    :class:`labs.clock.DeviceClock`: ``time.perf_counter()`` seconds on the CPU; on a GPU,
    events that say when the GPU reached each point, read by :meth:`resolved` once the step
    is over (a host clock there would say when each kernel was queued)."""

    grad_ready: dict[str, Moment] = field(default_factory=dict)
    """Parameter name -> when its gradient was accumulated (its hook ran)."""
    launched: dict[int, Moment] = field(default_factory=dict)
    """Bucket index -> when its all-reduce was launched (handed to gloo, or to the
    :class:`CommStream`)."""
    started: dict[int, Moment] = field(default_factory=dict)
    """Bucket index -> when the :class:`CommStream` began sending it (on an emulated link
    only; it may wait there behind earlier buckets)."""
    done: dict[int, Moment] = field(default_factory=dict)
    """Bucket index -> when its all-reduce completed (recorded by the work's future, or by
    the :class:`CommStream`)."""
    finished: Moment | None = None
    """When ``finish_gradient_synchronization()`` returned."""

    def resolved(self) -> StepTimeline:
        """This timeline with every moment in ``time.perf_counter()`` seconds (on a GPU it
        waits for the events it reads)."""
        def read(moments: dict[Any, Moment]) -> dict[Any, Moment]:
            return {key: seconds(m) for key, m in moments.items()}

        return StepTimeline(read(self.grad_ready), read(self.launched), read(self.started),
                            read(self.done),
                            None if self.finished is None else seconds(self.finished))


def params_in_graph(outputs: Any) -> set[int]:
    """``id()`` of every leaf tensor (parameter) the autograd graph of ``outputs`` reaches.

    torch DDP with ``find_unused_parameters=True`` walks this graph after each forward: a
    parameter it does not reach will get no gradient in the coming backward pass."""
    stack = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    seen: set[Any] = set()
    found: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class DDP(_SyncMixin, JoinMixin, nn.Module):
    """Bucketed data parallelism with communication overlapping backward.

    At construction: rank 0's parameters and buffers are broadcast, the trainable parameters
    are split into buckets (:func:`assign_buckets`), and each parameter gets a
    ``register_post_accumulate_grad_hook``. The hook receives the *parameter* (its ``.grad``
    is complete, tied uses included) and copies the gradient into its bucket; when a bucket
    is full, its ``all_reduce`` (a sum) is launched with ``async_op=True``, in bucket order.
    :meth:`finish_gradient_synchronization` waits for every bucket and writes sum / N back
    into ``p.grad``. (torch divides the bucket by N before its all-reduce: one more pass over
    the bucket, and at N not a power of two a different rounding.)

    On an emulated link (a launch given ``link=``), a full bucket goes instead to this
    wrapper's :class:`CommStream`, whose thread all-reduces the buckets one after another with
    :func:`all_reduce_sum` while backward goes on; finishing waits for that thread first.

    Memory: one extra copy of the trainable gradients (the buckets). torch's
    ``gradient_as_bucket_view=True`` avoids it by making ``p.grad`` a view of the bucket.

    Args:
        module: the model, identical on every rank after the broadcast.
        bucket_cap_mb: bucket size in MiB.
        find_unused_parameters: allow parameters that get no gradient in a backward pass.
            After each forward the autograd graph is walked (:func:`params_in_graph`); the
            slots of parameters it does not reach are zeroed and count as ready at once, so
            every rank still launches every bucket, in the same order. Synchronising then
            all-reduces one "used" flag per parameter: a parameter no rank used keeps
            ``grad = None``, as in one process. Without it, an unused parameter's bucket is
            never full and synchronising raises, naming it.
        broadcast_buffers: re-broadcast rank 0's buffers before every forward, as torch
            does (running statistics stay equal on every rank).
        overlap: launch each bucket's all-reduce as soon as it is full (the default). False
            is the control that shows what overlapping buys: the same buckets are filled by the
            same hooks, but nothing is launched until
            :meth:`finish_gradient_synchronization`, which then launches every bucket in order
            and waits: the same messages, none of them sent while backward computes.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, *,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 process_group: dist.ProcessGroup | None = None, overlap: bool = True) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.overlap = overlap
        self.require_backward_grad_sync = True
        self.world_size = dist.get_world_size(process_group)
        #: What finishing divides the summed gradients by: N, or inside :meth:`join` with
        #: ``divide_by_initial_world_size=False`` the ranks still training this step.
        self._divisor = self.world_size
        #: Inside :meth:`join`, while this rank still trains: whether to divide by N; None
        #: outside.
        self._joining: bool | None = None
        self.timeline = StepTimeline()
        #: What stamps ``timeline``: the host's clock on the CPU, a GPU's events on CUDA.
        self.clock = DeviceClock.of(module)
        #: Where buckets are all-reduced on an emulated link; None: gloo's own async collective.
        self._stream = CommStream() if link.active() is not None else None
        broadcast_state(module, process_group)
        self.buckets: list[Bucket] = []
        #: parameter id -> (its bucket, its position there, its index in the flat order)
        self._where: dict[int, tuple[Bucket, int, int]] = {}
        self._params: list[nn.Parameter] = []
        for index, members in enumerate(assign_buckets(trainable_parameters(module),
                                                       bucket_cap_mb)):
            offsets, total = [], 0
            for _, p in members:
                offsets.append(total)
                total += p.numel()
            first = members[0][1]
            bucket = Bucket(index, [n for n, _ in members], [p for _, p in members], offsets,
                            torch.zeros(total, dtype=first.dtype, device=first.device))
            self.buckets.append(bucket)
            for position, (_, p) in enumerate(members):
                self._where[id(p)] = (bucket, position, len(self._params))
                self._params.append(p)
        self._next_launch = 0
        self._locally_used: list[bool] = [False] * len(self._params)
        wrapped = [n for b in self.buckets for n, p in zip(b.names, b.params, strict=True)
                   if getattr(p, _OWNER, None) is not None]
        if wrapped:
            raise ValueError(
                f"DDP: {wrapped[0]} is already hooked by another DDP wrapper, whose hooks would "
                "also fire. Call remove_hooks() on the old wrapper first, or wrap a fresh model.")
        self._hooks = []
        for p in self._params:
            setattr(p, _OWNER, True)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def remove_hooks(self) -> None:
        """Detach this wrapper from the module's parameters (to wrap the module again)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for p in self._params:
            if hasattr(p, _OWNER):
                delattr(p, _OWNER)

    def _root(self) -> int:
        return dist.get_global_rank(self.process_group, 0) if self.process_group else 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if any(b.arrived for b in self.buckets):
            raise RuntimeError(
                "DDP: the previous backward pass was not synchronised. Call "
                "model.finish_gradient_synchronization() after loss.backward() and before "
                "optimizer.step() (or run that backward inside model.no_sync()).")
        if self._joining is not None and torch.is_grad_enabled() \
                and self.require_backward_grad_sync:
            # "still training": 1 from every rank that is, 0 from each rank that has joined
            training = self._count_training(1.0)
            self._divisor = self.world_size if self._joining else int(training)
        self._broadcast_buffers()
        output = self.module(*args, **kwargs)
        if (self.find_unused_parameters and self.require_backward_grad_sync
                and torch.is_grad_enabled()):
            self._mark_unused(params_in_graph(output))
        return output

    def _sum_over_ranks(self, tensor: torch.Tensor) -> None:
        all_reduce_sum(tensor, self.process_group)

    def _broadcast_buffers(self) -> None:
        if self.broadcast_buffers and self.world_size > 1:
            with torch.no_grad():
                for buffer in self.module.buffers():
                    dist.broadcast(buffer, src=self._root(), group=self.process_group)

    def _mark_unused(self, reached: set[int]) -> None:
        """Count the parameters the graph does not reach as ready now. Their slot holds the
        gradient accumulated so far (inside ``no_sync()``), or zeros if there is none; a
        parameter with an accumulated gradient counts as used (as in torch's reducer)."""
        for k, param in enumerate(self._params):
            if id(param) in reached:
                self._locally_used[k] = True
                continue
            bucket, position, _ = self._where[id(param)]
            if param.grad is None:
                bucket.slot(position).zero_()
                self._locally_used[k] = False
            else:
                bucket.slot(position).copy_(param.grad)
                self._locally_used[k] = True
            self._arrive(bucket, position)

    # -- during backward --

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: runs once per parameter per backward pass."""
        if not self.require_backward_grad_sync:
            return
        bucket, position, _ = self._where[id(param)]
        self.timeline.grad_ready[bucket.names[position]] = self.clock.stamp()
        if position in bucket.arrived:
            raise RuntimeError(
                f"DDP: {bucket.names[position]}'s gradient arrived twice before "
                "finish_gradient_synchronization(): put no_sync() around the first backward "
                "pass, or synchronise between the two.")
        assert param.grad is not None
        bucket.slot(position).copy_(param.grad)
        self._arrive(bucket, position)

    def _arrive(self, bucket: Bucket, position: int) -> None:
        bucket.arrived.add(position)
        if len(bucket.arrived) == len(bucket.params):
            bucket.state = BucketState.READY
            if self.overlap:
                self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch READY buckets in index order: collectives must match across ranks, and a
        bucket that fills early on one rank may fill late on another."""
        while (self._next_launch < len(self.buckets)
               and self.buckets[self._next_launch].state is BucketState.READY):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        self.timeline.launched[bucket.index] = self.clock.stamp()
        bucket.state = BucketState.LAUNCHED
        if self._stream is not None:
            bucket.work = self._stream.submit(
                lambda t=self.timeline: self._all_reduce_on_stream(bucket, t))
            return
        bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        done, clock = self.timeline.done, self.clock
        # The callback runs once the work completes; on CUDA the future completes when the
        # all-reduce is queued, but the callback's current stream waits for it, so the event
        # the clock records there is reached when the all-reduce has ended.
        bucket.work.get_future().then(
            lambda _fut, i=bucket.index: done.__setitem__(i, clock.stamp()))

    def _all_reduce_on_stream(self, bucket: Bucket, timeline: StepTimeline) -> None:
        """A :class:`CommStream` job: sum one bucket over the ranks, on the link."""
        timeline.started[bucket.index] = self.clock.stamp()
        all_reduce_sum(bucket.buffer, self.process_group)
        timeline.done[bucket.index] = self.clock.stamp()

    # -- after backward --

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and write the averages into ``p.grad``."""
        if not self.require_backward_grad_sync:
            return
        missing = [b.names[i] for b in self.buckets for i in range(len(b.params))
                   if i not in b.arrived]
        if missing:
            hint = ("their slots were not marked ready after forward (was the loss computed "
                    "from this forward's output?)" if self.find_unused_parameters else
                    "use every parameter in forward, freeze the unused ones "
                    "(requires_grad=False), or pass find_unused_parameters=True")
            raise RuntimeError(
                f"DDP: parameter(s) {missing} got no gradient in this backward pass, so their "
                "buckets were never full and never all-reduced; the other ranks may be "
                f"waiting for them. To fix it: {hint}.")
        if not self.overlap:
            self._launch_ready()  # every bucket is READY now: all of them, in order
        if self._stream is not None:
            self._stream.synchronize()  # every bucket summed; the main thread may talk again
        used = self._globally_used() if self.find_unused_parameters else None
        for bucket in self.buckets:
            if self._stream is None:
                bucket.work.wait()
            for position, param in enumerate(bucket.params):
                if param.grad is not None and (used is None or self._locally_used[
                        self._where[id(param)][2]]):
                    # the mean, written straight into .grad: dividing here rather than before
                    # the all-reduce saves one pass over the bucket
                    torch.div(bucket.slot(position), self._divisor, out=param.grad)
                elif used is not None and used[self._where[id(param)][2]]:
                    param.grad = bucket.slot(position) / self._divisor  # a peer used it
            bucket.arrived.clear()
            bucket.state, bucket.work = BucketState.FILLING, None
        self._next_launch = 0
        self.timeline.finished = self.clock.stamp()

    def _globally_used(self) -> list[bool]:
        """One extra small all-reduce, after every bucket's: which parameters got a gradient
        on at least one rank."""
        if not self._params:
            return []
        flags = torch.tensor(self._locally_used, dtype=torch.int32,
                             device=self.buckets[0].buffer.device)
        dist.all_reduce(flags, group=self.process_group)
        return [bool(f) for f in flags.tolist()]
