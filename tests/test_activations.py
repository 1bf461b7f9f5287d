"""labs.activations: the closed form of activation memory equals both measures (saved-tensor
hooks, storages alive after forward) exactly, for the chapter's transformer and MLP, with and
without activation checkpointing; storages count once; checkpointing leaves gradients
bit-identical and recomputes each block once; bad input is refused; labs.viz.activations'
tables and figure. One process: no ranks are needed here."""

import collections

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from matplotlib.figure import Figure
from torch import nn

from labs.activations import (
    LOSS,
    MODEL,
    ActivationMeasure,
    SavedKind,
    Workload,
    activation_bytes,
    gradients,
    measure_alive,
    measure_saved,
    mlp_activation_bytes,
    recomputed_modules,
)
from labs.experiments.activations import (
    CHAPTER_MODEL,
    ActivationSettings,
    CheckpointCase,
    backward_peak,
    checkpointing_model,
    measure_checkpointing,
    mlp_workload,
)
from labs.experiments.zero import LAB_SETTINGS
from labs.models import StepSettings
from labs.viz.activations import (
    activation_table,
    checkpointing_table,
    plot_activations,
    saved_tensors_table,
)

#: (batch, seq_len, d_model, n_heads, n_layers): one token, odd sizes, several heads and layers
SHAPES = [(1, 1, 4, 1, 1), (2, 5, 12, 3, 2), (3, 7, 8, 2, 3), (2, 16, 32, 4, 1)]
BLOCK_MODULES = ("ln1", "attn", "attn.qkv", "attn.proj", "ln2", "mlp", "mlp.0", "mlp.1", "mlp.2")


def settings_of(shape, dtype=torch.float32):
    return ActivationSettings(*shape, dtype=dtype)


# --- the closed form against both measures -------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_closed_form_equals_both_measures(shape):
    s = settings_of(shape)
    saved, alive = measure_saved(s.workload()), measure_alive(s.workload())
    assert saved.measure is ActivationMeasure.SAVED and alive.measure is ActivationMeasure.ALIVE
    assert saved.total_bytes == alive.total_bytes == s.activation_bytes()
    b, t, d, h, n = shape
    per_block = b * t * (16 * d + h * t + 4) * 4 + t * t
    for i in range(n):
        assert saved.bytes_by_layer()[f"blocks.{i}"] == per_block
        assert alive.bytes_by_layer()[f"blocks.{i}"] == per_block
    assert saved.output_bytes == alive.output_bytes == 4  # the loss: the caller's, apart
    # The check can fail: without the attention term (H x T per token) it does not match.
    assert saved.total_bytes - n * b * t * h * t * 4 != saved.total_bytes


def test_the_closed_form_holds_in_bfloat16():
    s = settings_of((2, 6, 8, 2, 2), torch.bfloat16)
    assert s.activation_bytes() == activation_bytes(2, 6, 8, 2, 2, s.vocab, element_size=2)
    assert measure_saved(s.workload()).total_bytes == s.activation_bytes()
    assert measure_alive(s.workload()).total_bytes == s.activation_bytes()


def test_on_cuda_the_layer_norm_statistics_are_float32_in_any_dtype():
    """CUDA's LayerNorm keeps mean and rstd in float32: in bf16, 2 more bytes for each of the
    4 statistics per token of each block and the 2 of ln_f (measured on a GPU in
    tests/test_gpu.py); in float32 and float64 nothing changes."""
    b, t, d, h, n, v = 2, 6, 8, 2, 3, 11
    cpu, cuda = (activation_bytes(b, t, d, h, n, v, element_size=2, device_type=kind)
                 for kind in ("cpu", "cuda"))
    assert cuda - cpu == b * t * (4 * n + 2) * 2
    for e in (4, 8):
        assert activation_bytes(b, t, d, h, n, v, element_size=e, device_type="cuda") == \
            activation_bytes(b, t, d, h, n, v, element_size=e)
    with pytest.raises(ValueError, match="device_type must be 'cpu' or 'cuda', got 'gpu'"):
        activation_bytes(b, t, d, h, n, v, device_type="gpu")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_checkpointed_bytes_are_the_block_boundaries(shape):
    s = settings_of(shape)
    b, t, d, _, n = shape
    alive = measure_alive(s.workload(checkpointing=True))
    assert alive.total_bytes == s.activation_bytes(checkpointing=True)
    for i in range(n):  # each block keeps one (B, T, D) tensor: its output, the next one's input
        assert alive.bytes_by_layer()[f"blocks.{i}"] == b * t * d * 4
    # The pack hook sees the checkpoints' inputs (saved outside their hooks) and nothing inside.
    saved = measure_saved(s.workload(checkpointing=True))
    assert saved.total_bytes == alive.total_bytes
    assert all(x.module == f"blocks.{i}" for i in range(n) for x in saved.saved_in(f"blocks.{i}"))
    assert s.activation_bytes(checkpointing=True) != s.activation_bytes()


@pytest.mark.parametrize("batch, width, layers", [(LAB_SETTINGS.batch, LAB_SETTINGS.width,
                                                   LAB_SETTINGS.layers), (3, 5, 1), (5, 7, 3)])
def test_the_mlp_closed_form_equals_both_measures(batch, width, layers):
    settings = StepSettings(width=width, layers=layers, batch=batch)
    saved, alive = measure_saved(mlp_workload(settings)), measure_alive(mlp_workload(settings))
    want = mlp_activation_bytes(batch, width, layers)
    assert saved.total_bytes == alive.total_bytes == want == batch * width * layers * 4
    # One (B, W) tensor per ReLU, none per Linear: a Linear's input is the ReLU's output.
    for i in range(2 * layers):
        assert saved.bytes_by_layer()[str(i)] == (batch * width * 4 if i % 2 else 0)
    # The first Linear's input is the batch; the loss's square saves the last ReLU's output again.
    kinds = collections.Counter(x.kind for x in saved.saved)
    assert kinds[SavedKind.BATCH] == 1 and kinds[SavedKind.REPEAT] == layers


def test_one_block_saves_what_the_derivation_lists():
    b, t, d, h = 2, 5, 12, 3
    report = measure_saved(settings_of((b, t, d, h, 2)).workload())
    counted = collections.Counter(
        (x.module.removeprefix("blocks.1."), x.op, x.storage_bytes)
        for x in report.saved_in("blocks.1") if x.kind is SavedKind.ACTIVATION)
    token, stat = b * t * d * 4, b * t * 4
    assert counted == collections.Counter({
        ("ln1", "layer_norm", token): 1, ("ln1", "layer_norm", stat): 2,  # input, mean, rstd
        ("attn.qkv", "linear", token): 1,
        ("attn", "matmul", token): 3,  # copies of q, k (q @ k^T) and v (weights @ v)
        ("attn", "masked_fill", t * t): 1,  # the T x T bool mask
        ("attn", "softmax", b * h * t * t * 4): 1,
        ("attn.proj", "linear", token): 1,
        ("ln2", "layer_norm", token): 1, ("ln2", "layer_norm", stat): 2,
        ("mlp.0", "linear", token): 1,
        ("mlp.1", "gelu", 4 * token): 1,
        ("mlp.2", "linear", 4 * token): 1,
    })
    not_counted = collections.Counter(x.kind for x in report.saved_in("blocks.1")
                                      if x.kind is not SavedKind.ACTIVATION)
    # weights and LayerNorm scales/shifts; the softmax output, saved again by weights @ v
    assert not_counted == {SavedKind.PARAMETER: 8, SavedKind.REPEAT: 1}


def test_the_measures_agree_on_blocks_and_differ_outside_by_attribution():
    b, t, d = 2, 5, 12
    s = settings_of((b, t, d, 3, 2))
    saved, alive = measure_saved(s.workload()).bytes_by_layer(), \
        measure_alive(s.workload()).bytes_by_layer()
    for name in ("blocks.0", "blocks.1", "ln_f", LOSS):
        assert saved[name] == alive[name]
    # The position ids are saved by pos_emb but made in the model's forward (torch.arange), as
    # is the embeddings' sum (saved by blocks.0.ln1); ln_f's output is saved by the head.
    assert (saved[MODEL], saved["pos_emb"], saved["head"]) == (0, 8 * t, b * t * d * 4)
    assert (alive[MODEL], alive["pos_emb"], alive["head"]) == (8 * t + b * t * d * 4, 0, 0)


# --- what is and is not counted ------------------------------------------------------------------


class TwiceAndViews(nn.Module):
    """``t * t`` saves t twice; ``t[:, :1] * t[:, 1:2]`` saves two small views of t."""

    def __init__(self, width: int, views: bool) -> None:
        super().__init__()
        self.lin, self.views = nn.Linear(width, width), views

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.lin(x)  # (B, W), a new storage
        return (t[:, :1] * t[:, 1:2] if self.views else t * t).sum()


def naive_bytes(report):
    """A wrong counter: every saved tensor's own bytes, but for parameters and the batch."""
    return sum(x.nbytes for x in report.saved
               if x.kind not in (SavedKind.PARAMETER, SavedKind.BATCH))


@pytest.mark.parametrize("views", [False, True], ids=["same tensor twice", "two views"])
def test_a_storage_counts_once_at_its_whole_size(views):
    batch, width = 3, 6
    workload = Workload(TwiceAndViews(width, views), (torch.randn(batch, width),),
                        lambda model, x: model(x))
    report = measure_saved(workload)
    storage = batch * width * 4
    assert report.total_bytes == storage == measure_alive(workload).total_bytes
    assert [x.kind for x in report.saved if x.op == "mul"] == [SavedKind.ACTIVATION,
                                                              SavedKind.REPEAT]
    # Counting tensors instead of storages is wrong both ways: twice the bytes for t * t,
    # only the views' bytes (2 of the 6 columns) for the views, which keep all of t alive.
    assert naive_bytes(report) == (2 * batch * 4 if views else 2 * storage)
    assert naive_bytes(report) != report.total_bytes


def test_parameters_tied_weights_and_the_batch_are_not_activations():
    s = settings_of((2, 5, 12, 3, 1))
    workload = s.workload()
    report = measure_saved(workload)
    head = [x for x in report.saved if x.module == "head"]
    # The tied head weight is the embedding's parameter: listed, not counted.
    assert [x.kind for x in head] == [SavedKind.PARAMETER, SavedKind.ACTIVATION]
    assert head[0].shape == tuple(workload.model.tok_emb.weight.T.shape)
    batch = [x for x in report.saved if x.kind is SavedKind.BATCH]
    assert [(x.module, x.op) for x in batch] == [("tok_emb", "embedding"), (LOSS, "cross_entropy")]


def test_a_frozen_weight_drops_what_only_its_gradient_needed():
    b, t, d = 2, 5, 12
    s = settings_of((b, t, d, 3, 2))
    workload = s.workload()
    # mlp.2's input (GELU's output) is needed only for mlp.2's weight gradient.
    workload.model.blocks[0].mlp[2].weight.requires_grad_(False)
    want = s.activation_bytes() - b * t * 4 * d * 4
    assert measure_saved(workload).total_bytes == measure_alive(workload).total_bytes == want


def test_hooks_are_removed_when_forward_raises():
    workload = settings_of((1, 2, 4, 1, 1)).workload()

    def broken(model, ids, targets):
        model(ids)
        raise RuntimeError("loss failed")

    bad = Workload(workload.model, workload.batch, broken)
    for measure in (measure_saved, measure_alive):
        with pytest.raises(RuntimeError, match="loss failed"):
            measure(bad)
    assert all(not m._forward_hooks and not m._forward_pre_hooks
               for m in workload.model.modules())
    assert measure_saved(workload).total_bytes == settings_of((1, 2, 4, 1, 1)).activation_bytes()


# --- checkpointing: same gradients, forward run again, the chapter's target --------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_checkpointing_leaves_gradients_bit_identical(dtype):
    s = settings_of((2, 5, 12, 3, 3), dtype)
    plain, checkpointed = s.workload(), s.workload(checkpointing=True)
    for w in (plain, checkpointed):  # a frozen parameter, beside the tied one
        w.model.blocks[1].ln1.weight.requires_grad_(False)
    want, got = gradients(plain), gradients(checkpointed)
    assert "blocks.1.ln1.weight" not in want and "tok_emb.weight" in want
    assert want.keys() == got.keys()
    for name in want:  # the same ops on the same numbers, recomputed: equal bit for bit
        assert torch.equal(want[name], got[name]), name


def test_backward_recomputes_each_block_once():
    s = settings_of((2, 5, 12, 3, 3))
    assert recomputed_modules(s.workload()) == ()
    ran = recomputed_modules(s.workload(checkpointing=True))
    assert collections.Counter(ran) == {f"blocks.{i}.{m}": 1 for i in range(3)
                                        for m in BLOCK_MODULES}
    assert ran[0].startswith("blocks.2.")  # backward starts from the last block


def test_the_chapter_model_keeps_at_most_a_third():
    assert (CHAPTER_MODEL.n_layers, CHAPTER_MODEL.dtype) == (8, torch.float32)
    without = measure_alive(CHAPTER_MODEL.workload()).total_bytes
    with_ = measure_alive(CHAPTER_MODEL.workload(checkpointing=True)).total_bytes
    assert without == CHAPTER_MODEL.activation_bytes()
    assert with_ == CHAPTER_MODEL.activation_bytes(checkpointing=True)
    assert with_ <= without / 3


def test_measure_checkpointing_reports_both_cases():
    s = ActivationSettings(2, 5, 12, 3, 2, repeats=3, warmup=1)
    without, with_ = measure_checkpointing(s)
    assert (without.checkpointing, with_.checkpointing) == (False, True)
    for case in (without, with_):
        assert case.activation_bytes == case.formula_bytes
        assert len(case.seconds) == 3 and case.min_seconds <= case.median_seconds \
            <= case.max_seconds
    assert (without.recomputed, with_.recomputed) == (0, 2 * len(BLOCK_MODULES))
    for case in (without, with_):  # each step's forward is a part of it
        assert len(case.forward_seconds) == 3
        assert all(0 < f < t for f, t in zip(case.forward_seconds, case.seconds, strict=True))
        assert case.median_forward > 0 and case.median_backward > 0


def test_the_checkpointing_model_adds_one_forward_to_the_step():
    def case(forward: float, step: float) -> CheckpointCase:
        return CheckpointCase(False, 0, 0, (step,), 0, (forward,))

    assert checkpointing_model(case(1.0, 3.0)) == pytest.approx(4 / 3)  # B = 2F: the rule
    assert checkpointing_model(case(1.0, 2.0)) == pytest.approx(3 / 2)  # B = F
    assert checkpointing_model(case(2.0, 3.0)) != pytest.approx(4 / 3)  # B = F/2: not the rule


# --- bad input is refused, with advice -----------------------------------------------------------


@pytest.mark.parametrize("kwargs, advice", [
    ({"batch": 0}, "batch must be a positive whole number"),
    ({"seq_len": 2.0}, "seq_len must be a positive whole number"),
    ({"n_layers": True}, "n_layers must be a positive whole number"),
    ({"vocab": -1}, "vocab must be a positive whole number"),
    ({"d_model": 10, "n_heads": 4}, "pick a multiple of n_heads"),
    ({"element_size": 3}, "4 for fp32, 2 for bf16"),
    ({"checkpointing": "yes"}, "True or False"),
])
def test_activation_bytes_refuses_bad_input(kwargs, advice):
    args = {"batch": 2, "seq_len": 4, "d_model": 8, "n_heads": 2, "n_layers": 1, "vocab": 5}
    element = {k: kwargs.pop(k) for k in ("element_size", "checkpointing") if k in kwargs}
    with pytest.raises(ValueError, match=advice):
        activation_bytes(**{**args, **kwargs}, **element)


def test_settings_and_workloads_refuse_bad_input():
    with pytest.raises(ValueError, match="pick a multiple of n_heads"):
        ActivationSettings(d_model=10, n_heads=4)
    with pytest.raises(ValueError, match="floating torch.dtype"):
        ActivationSettings(dtype=torch.int32)
    with pytest.raises(ValueError, match="warmup must be"):
        ActivationSettings(warmup=-1)
    with pytest.raises(ValueError, match="width must be a positive"):
        mlp_activation_bytes(2, 0, 1)
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="is not a module of the model"):
        Workload(model, (torch.zeros(1, 2),), lambda m, x: m(x).sum(), ("1",))
    with pytest.raises(ValueError, match="is inside layer"):
        Workload(model, (torch.zeros(1, 2),), lambda m, x: m(x).sum(), ("0", "0.0"))
    with pytest.raises(TypeError, match="tuple of tensors"):
        Workload(model, ([0.0, 1.0],), lambda m, x: m(x).sum())


# --- labs.viz.activations ------------------------------------------------------------------------


def test_tables_and_figure():
    s = settings_of((2, 5, 12, 3, 2))
    reports = {"without": measure_alive(s.workload()),
               "with checkpointing": measure_alive(s.workload(checkpointing=True))}
    table = activation_table(reports)
    assert "blocks.1" in table and str(s.activation_bytes(checkpointing=True)) in table
    saved = measure_saved(s.workload())
    block = saved_tensors_table(saved, "blocks.0")
    assert "softmax" in block and "parameter" in block and "repeat" in block
    assert block.splitlines()[-1].split() == ["total", str(saved.bytes_by_layer()["blocks.0"])]
    cases = measure_checkpointing(ActivationSettings(2, 5, 12, 3, 2, repeats=1, warmup=0))
    assert "recomputed forwards" in checkpointing_table(cases)
    fig = plot_activations(reports)
    assert isinstance(fig, Figure)
    assert len(fig.axes[0].get_xticklabels()) == len(reports["without"].layers)
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_activations({})
    with pytest.raises(ValueError, match="measure with measure_saved"):
        saved_tensors_table(reports["without"], "blocks.0")


def test_checkpointing_peaks_in_backward_with_one_block_rebuilt():
    s = ActivationSettings(2, 5, 12, 3, 3)
    plain = backward_peak(s.workload(), checkpointing=False)
    ckpt = backward_peak(s.workload(checkpointing=True), checkpointing=True)
    one_block = measure_saved(s.workload()).bytes_by_layer()["blocks.0"]
    # after forward: what the closed forms give (and the loss, a 4-byte scalar)
    assert plain.after_forward == s.activation_bytes() + 4
    assert ckpt.after_forward == s.activation_bytes(checkpointing=True) + 4
    # in backward the block being recomputed is whole again, beside the kept inputs
    assert ckpt.backward_peak >= ckpt.after_forward + one_block
    assert ckpt.backward_peak < plain.backward_peak
