"""precision=fp8's tensorwise recipe under tp, as train splits it and simulate traces it:
torchao's float8 styles cast each split layer's input to float8 and keep that copy for
backward; a gathered input is cast before its gather (one byte an element) and kept once
for the layers it feeds (a transformers block's q, k and v; gate and up).

gloo carries no float8, so what a rank gathers and keeps is measured on torch's fake
process group (float8 kernels run for real on this CPU; the collectives return at once),
and the values on one gloo rank."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_LLAMA
from test_simulate import GPT, configured, traced

LLAMA = [*TINY_LLAMA, "data.seq_len=32", "data.batch_size=2"]
ROWS, SEQ, TP = 2, 32, 2


def _local(t: torch.Tensor) -> torch.Tensor:
    """What a rank holds of `t`: a DTensor's shard, a float8 tensor's one-byte data."""
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return getattr(t, "_data", t)


class _Collectives(torch.utils._python_dispatch.TorchDispatchMode):
    """Each collective's kind and the bytes of its input (a float8 one's data)."""

    KINDS = {"all_gather_into_tensor": "all_gather", "all_reduce": "all_reduce",
             "reduce_scatter_tensor": "reduce_scatter"}

    def __init__(self):
        super().__init__()
        self.sent: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self.KINDS.get(func._opname) if func.namespace == "_c10d_functional" else None
        if kind is not None:
            data = _local(args[0])
            self.sent.append((kind, data.numel() * data.element_size()))
        return func(*args, **(kwargs or {}))


def _model(kind: str, base: list[str], layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        from parallab.models.gpt import GPT as Gpt

        return Gpt(layers=layers, heads=4, width=64, context=64)
    from transformers import LlamaConfig, LlamaForCausalLM

    given = configured(*base).model["config"]
    return LlamaForCausalLM(LlamaConfig(**{**{k: v for k, v in dict(given).items()
                                              if k != "_target_"},
                                           "num_hidden_layers": layers}))


def _trained_block(kind: str, base: list[str], sequence_parallel: bool, bf16_weights: bool
                   ) -> tuple[int, list[tuple[str, int]], int]:
    """Train's split of the model (fp8, tensorwise) on a rank of tp 2: the bytes its first
    block keeps for backward (not its weights), its forward's collectives and how many
    collectives it runs in all."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from parallab.config.schema import PrecisionConfig
    from parallab.launching.distributed import fake_group
    from parallab.parallel import tp_plans
    from parallab.precision import Precision

    precision = Precision(PrecisionConfig(name="fp8", fp8_recipe="tensorwise"),
                          torch.device("cpu"))
    model = _model(kind, base)
    model = precision.convert(model.to(torch.bfloat16) if bf16_weights else model)
    block = model.model.layers[0] if kind == "llama" else model.blocks[0]
    kept: dict[int, int] = {}
    gathers, inside, first = _Collectives(), [], []

    def pack(t):
        if inside:
            storage = _local(t).untyped_storage()
            kept[storage._cdata] = storage.nbytes()
        return t

    counted = CommDebugMode()  # sees too what DTensor runs inside an op (a scale's amax)
    reduces = []

    def entered(*_):
        inside.append(1)
        first.append(len(gathers.sent))
        reduces.append(counted.get_total_counts())

    def left(*_):
        inside.clear()
        first.append(len(gathers.sent))
        reduces.append(counted.get_total_counts())

    block.register_forward_pre_hook(entered)
    block.register_forward_hook(left)
    with fake_group(TP):
        mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
        tp_plans.split(model, mesh, None, sequence_parallel, _WholeLogits())
        tokens = torch.randint(0, 256, (ROWS, SEQ))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                precision.autocast(), counted, gathers:
            logits = model(tokens)
        getattr(logits, "logits", logits).float().sum().backward()
        weights = {_local(p).untyped_storage()._cdata for p in model.parameters()}
    return (sum(b for key, b in kept.items() if key not in weights),
            gathers.sent[first[0]:first[1]], reduces[1] - reduces[0])


class _WholeLogits:
    takes_sharded_logits = False


# a block's split float8 layers' casts of what is cut over tp, in forward: each weight,
# each row split's input, each input cast before its gather (Llama: 7 layers, 2 row
# splits, 2 gathers; gpt: 4, 2, 2)
@pytest.mark.filterwarnings("ignore::UserWarning")  # CommDebugMode's module tracking
@pytest.mark.parametrize("kind,sequence_parallel,bf16_weights,scales", [
    ("llama", True, False, 11), ("llama", True, True, 11), ("llama", False, True, 9),
    ("gpt", True, False, 8)],
    ids=["llama-sp-autocast", "llama-sp-bf16", "llama-tp-bf16", "gpt-sp-autocast"])
def test_a_traced_float8_block_keeps_and_gathers_what_trains_split_does(
        kind, sequence_parallel, bf16_weights, scales):
    """simulate's traced block (the bf16 step, the split float8 layers' copies counted one
    byte a value) keeps for backward what train's float8 block keeps, byte for byte, and
    its forward's all-gathers move what train's move: under the sequence-parallel plans,
    each gathered input once in one byte an element (a float32 stream's too, under
    autocast), kept once for the layers it feeds."""
    from parallab.simulate.trace import Shape

    base = LLAMA if kind == "llama" else GPT
    found = traced(Shape(tp=TP, sequence_parallel=sequence_parallel, rows=ROWS, seq_len=SEQ,
                         precision="fp8", gathered=bf16_weights), base=base)
    sends = [(op.collective, op.sent) for op in found.ops if op.kind == "collective" and
             op.region == "block" and op.phase == "forward"]
    kept, sent, runs = _trained_block(kind, base, sequence_parallel, bf16_weights)
    assert found.saved["block"] == kept
    gathers = [b for kind, b in sends if kind == "all_gather"]
    assert gathers == [b for kind, b in sent if kind == "all_gather"] == (
        [ROWS * SEQ // TP * 64] * 2 if sequence_parallel else [])
    # as many collectives: among them the all-reduce of each cast's scale where what it
    # casts is cut, which DTensor runs inside the cast, unseen by a dispatch of its own
    assert len(sends) == runs == len(sent) + scales


def test_a_float8_blocks_bytes_kept_fall_below_bf16s():
    """What the copies are worth: the traced block in float8 keeps less than in bf16, by
    the gathered inputs' second byte (not by q, k and v thrice: they keep one copy) and the
    down projection's input's; the output projection's input, a view of what the attention
    keeps in bf16, is one byte more: its float8 copy."""
    from parallab.simulate.trace import Shape

    shape = dict(tp=TP, sequence_parallel=True, rows=ROWS, seq_len=SEQ, gathered=True)
    bf16, fp8 = (traced(Shape(**shape, precision=p), base=LLAMA).saved["block"]
                 for p in ("bf16", "fp8"))
    gathered, o_proj, down = ROWS * SEQ * 64, ROWS * SEQ * 64 // TP, ROWS * SEQ * 128 // TP
    assert bf16 - fp8 == 2 * gathered + down - o_proj
    # selective checkpointing keeps the split layers' outputs, bf16 in both, not inputs
    bf16, fp8 = (traced(Shape(**shape, precision=p, checkpointing="selective"),
                        base=LLAMA).saved["block"] for p in ("bf16", "fp8"))
    assert fp8 == bf16 > 0


def _one_rank(rank: int, store: str, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

    from parallab.config.schema import PrecisionConfig
    from parallab.parallel import tp_plans
    from parallab.precision import Precision

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    precision = Precision(PrecisionConfig(name="fp8", fp8_recipe="tensorwise"),
                          torch.device("cpu"))
    found = {}
    for split in (False, True):
        model = precision.convert(_model("llama", LLAMA))
        handed = []
        for name in ("q_proj", "k_proj", "v_proj"):
            layer = getattr(model.model.layers[0].self_attn, name)
            layer.register_forward_pre_hook(
                lambda _, args: handed.append(tensor_already_casted_to_fp8(args[0])))
        if split:
            tp_plans.split(model, mesh, None, True, _WholeLogits())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        torch.manual_seed(1)
        tokens = torch.randint(0, 256, (ROWS, SEQ))
        losses = []
        for _ in range(3):
            with precision.autocast():
                logits = model(tokens).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                     tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        found["split" if split else "whole"] = {"losses": losses, "handed": handed[:3]}
    with open(out, "w") as f:
        json.dump(found, f)
    dist.destroy_process_group()


@pytest.mark.distributed
def test_a_transformers_blocks_input_cast_before_its_gather_trains_as_the_model_whole(
        tmp_path):
    """The attention's input cast to float8 once, before the sequence is gathered (on one
    gloo rank: gloo carries no float8), and handed so to q, k and v: three steps' losses
    those of the model whole, where each layer casts it itself."""
    import json

    import torch.multiprocessing as mp

    out = tmp_path / "found.json"
    mp.spawn(_one_rank, args=(str(tmp_path / "store"), str(out)), nprocs=1)
    found = json.loads(out.read_text())
    assert found["split"]["handed"] == [True] * 3 and found["whole"]["handed"] == [False] * 3
    assert found["split"]["losses"] == pytest.approx(found["whole"]["losses"], rel=1e-6)
    assert len(set(found["whole"]["losses"])) == 3  # each step moved the weights


def test_only_an_input_that_feeds_float8_layers_alone_is_cast_before_its_gather():
    """feeds_float8: a Llama block's attention and MLP, and Qwen 3's attention (its q and k
    norms take the layers' outputs) feed float8 layers alone; an MoE layer (its router,
    its experts) and a module with weights of its own do not, nor a block left in bf16."""
    import transformers

    from parallab.parallel.float8_split import feeds_float8

    def float8(module):
        return type(module).__name__ == "Linear" and module.in_features % 16 == 0

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=2)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).model.layers[0]
    moe = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        head_dim=16)).model.layers[0]
    assert feeds_float8(llama.self_attn, float8) and feeds_float8(llama.mlp, float8)
    assert feeds_float8(moe.self_attn, float8) and not feeds_float8(moe.mlp, float8)
    assert not feeds_float8(llama.self_attn, lambda m: False)
    llama.self_attn.register_parameter("sinks", torch.nn.Parameter(torch.zeros(2)))
    assert not feeds_float8(llama.self_attn, float8)


def test_what_a_measured_step_keeps_counts_a_float8_copy_by_its_bytes():
    """activations.Saved (advise's measured memory) counts a float8 tensor autograd keeps
    by its one-byte data and its scale, not by the storage of its wrapper, which is sized
    as the bf16 tensor it stands for."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import e4m3_dtype
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    from parallab.parallel.activations import Saved

    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)).to(torch.bfloat16)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    handed = hp_tensor_to_float8_dynamic(torch.randn(32, 64, dtype=torch.bfloat16), e4m3_dtype,
                                         LinearMMConfig(), gemm_input_role=GemmInputRole.INPUT)
    saved = Saved(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        model(handed)
    assert saved() == 32 * 64 + 4  # float8 values, and the float32 scale


def test_a_split_float8_layers_matmuls_are_priced_with_the_casts_its_styles_make():
    """Float8Linear alone casts both operands of each of its three matmuls. Under tp's
    float8 styles the gathered inputs come cast (q, k, v; gate, up), once each on its
    slice before the gather, which the first matmul reading it pays; in backward the
    weight's gradient takes the output's gradient cast for the input's and the input
    kept cast: no cast of its own. A layer whose input is not gathered casts it itself."""
    from parallab.simulate.trace import Shape

    def matmuls(sequence_parallel: bool) -> list:
        found = traced(Shape(tp=TP, sequence_parallel=sequence_parallel, rows=ROWS,
                             seq_len=SEQ, precision="fp8", gathered=True), base=LLAMA)
        return [op for op in found.ops if op.fp8 and op.region == "block"]

    cut, whole = matmuls(True), matmuls(False)
    forward = [len(op.precast) for op in cut if op.phase == "forward"]
    assert forward == [1, 1, 1, 0, 1, 1, 0]  # q k v o, gate up down
    slice_bf16 = ROWS * SEQ * 64 * 2 / TP
    assert [op.slice_cast for op in cut if op.slice_cast] == [slice_bf16] * 2
    assert not any(op.precast for op in whole if op.phase == "forward")
    for ops in (cut, whole):
        backward = [len(op.precast) for op in ops if op.phase == "backward"]
        assert sorted(backward) == [0] * 7 + [2] * 7


def _backward_collectives(kind: str, base: list[str], sequence_parallel: bool,
                          layers: int) -> int:
    """The collectives train's split model (fp8, tensorwise, tp 2) runs in backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from parallab.config.schema import PrecisionConfig
    from parallab.launching.distributed import fake_group
    from parallab.parallel import tp_plans
    from parallab.precision import Precision

    precision = Precision(PrecisionConfig(name="fp8", fp8_recipe="tensorwise"),
                          torch.device("cpu"))
    model = precision.convert(_model(kind, base, layers).to(torch.bfloat16))
    with fake_group(TP):
        mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
        tp_plans.split(model, mesh, None, sequence_parallel, _WholeLogits())
        output = model(torch.randint(0, 256, (ROWS, SEQ)))
        with CommDebugMode() as counted:
            getattr(output, "logits", output).float().sum().backward()
    return counted.get_total_counts()


@pytest.mark.filterwarnings("ignore::UserWarning")  # CommDebugMode's module tracking
@pytest.mark.parametrize("kind,sequence_parallel", [("llama", True), ("llama", False),
                                                    ("gpt", True)])
def test_a_traced_float8_blocks_backward_runs_trains_collectives(kind, sequence_parallel):
    """A block's backward (a model of two blocks against one, in train) runs as many
    collectives as the traced block's: with its casts' scales, each weight again and each
    output gradient that is cut (a column split's; a row split's under sequence
    parallelism), beside the gradients' own reductions."""
    from parallab.simulate.trace import Shape

    base = LLAMA if kind == "llama" else GPT
    found = traced(Shape(tp=TP, sequence_parallel=sequence_parallel, rows=ROWS, seq_len=SEQ,
                         precision="fp8", gathered=True), base=base)
    traced_block = sum(op.kind == "collective" and op.region == "block" and
                       op.phase == "backward" for op in found.ops)
    two, one = (_backward_collectives(kind, base, sequence_parallel, n) for n in (2, 1))
    assert traced_block == two - one > 0


@pytest.mark.parametrize("bf16_weights,fewer", [(False, 2 * (8 - 2) + 5 * (4 + 2)),
                                                (True, 2 * (4 - 2))],
                         ids=["float32-stream", "bf16-stream"])
def test_what_train_does_to_a_float8_gather_is_priced_at_its_bytes(bf16_weights, fewer):
    """A float8 gather's chunks are put together in one byte an element, and autocast's
    copy of it (a float8 tensor's cast changes its metadata) is not run: a sequence-parallel
    Llama block's forward moves, of memory-bound bytes, 2 gathers' chunks read and written
    (float32: 4 bytes an element each way, against 1; bf16: 2) and the 5 copies q, k, v,
    gate and up read (4 bytes) and write (2) of a float32 stream less than in bf16."""
    from parallab.simulate.trace import Shape

    def moved(precision: str) -> float:
        found = traced(Shape(tp=TP, sequence_parallel=True, rows=ROWS, seq_len=SEQ,
                             precision=precision, gathered=bf16_weights), base=LLAMA)
        return sum(b for op in found.ops if op.kind == "memory" and op.region == "block"
                   and op.phase == "forward" for _, b in (*op.reads, *op.writes))

    assert moved("bf16") - moved("fp8") == fewer * ROWS * SEQ * 64
