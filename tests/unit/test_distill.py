"""Distillation (rsclip_ds.distill): the loss against its reference twin, a step's gradients on 2
gloo ranks against one process on the whole batch, the loader's two views, the teacher folder,
the config refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import SiglipModel  # noqa: F401 -- its import (~5 s) once here, not in every forked rank

from rsclip_ds.config import ConfigError, DataConfig
from rsclip_ds.distill.config import DistillConfig
from rsclip_ds.distill.loss import distill_loss, distill_loss_global
from rsclip_ds.distill.teacher import Distiller, Teacher, TeacherInputs, check_distill, load_teacher
from tests.unit.forked_ranks import run_ranks
from tests.helpers import planned_zero2

TEACHER_SIZE = 48   # tiny student: 64 px (model tests), 32 px (loader test)


def _teacher_config(vocab: int = 1000, image_size: int = TEACHER_SIZE, text_length: int = 24):
    """A teacher unlike the tiny student: wider, other image size, other text length and vocabulary."""
    from transformers import SiglipConfig

    text = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=text_length, vocab_size=vocab, pad_token_id=1, eos_token_id=1,
                bos_token_id=None)
    vision = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                  image_size=image_size, patch_size=8)
    return SiglipConfig(text_config=text, vision_config=vision)


def _teacher(seed: int = 5) -> Teacher:
    from transformers import SiglipModel

    torch.manual_seed(seed)
    model = SiglipModel(_teacher_config())
    with torch.no_grad():
        model.logit_scale.fill_(2.5)   # a trained teacher's temperature, not the student's
    return Teacher(model)


# --------------------------------------------------------------------------- the loss

def _features(n: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=-1) for _ in range(2)]


def _loss_on_rank(rank: int, world: int, b: int, loss: str) -> dict:
    image, text = (x.requires_grad_() for x in _features(world * b, 8, seed=b))
    t_image, t_text = _features(world * b, 12, seed=100 + b)
    scale = torch.tensor([5.0 if loss == "clip" else 2.0], requires_grad=True)   # clip: above the clamp
    rows = slice(rank * b, (rank + 1) * b)
    mine_i, mine_t = image.detach()[rows].clone().requires_grad_(), text.detach()[rows].clone().requires_grad_()
    value = distill_loss_global(mine_i, mine_t, scale, t_image[rows], t_text[rows], torch.tensor(3.0),
                                rank=rank, world_size=world, loss=loss)
    value.backward()
    import torch.distributed as dist

    total = value.detach().clone()
    dist.all_reduce(total)
    grad_scale = scale.grad.clone()
    dist.all_reduce(grad_scale)
    ref = distill_loss(image, text, scale, t_image, t_text, torch.tensor(3.0), loss=loss)
    ref_grads = torch.autograd.grad(ref, [image, text, scale])
    # all_gather's backward sums the W ranks' gradients; DeepSpeed's average divides by W
    def rel(got, want):   # relative to the largest gradient: clip's scale of 100 makes them large
        return ((got - want).abs().max() / want.abs().max().clamp(min=1e-12)).item()

    return {"loss": [total.item() / world, ref.item()], "image": rel(mine_i.grad / world, ref_grads[0][rows]),
            "text": rel(mine_t.grad / world, ref_grads[1][rows]),
            "scale": (grad_scale / world - ref_grads[2]).abs().max().item(),
            "scale_grad": ref_grads[2].abs().item()}


@pytest.mark.parametrize("loss", ["siglip", "clip"])
def test_global_distill_loss_and_gradients_equal_the_reference_on_two_ranks(loss, tmp_path):
    for b in (1, 3, 6):
        for rank in run_ranks(_loss_on_rank, 2, tmp_path / f"{loss}{b}", b, loss):
            assert "error" not in rank, rank.get("traceback")
            got, ref = rank["value"]["loss"]
            assert got == pytest.approx(ref, rel=1e-6)
            assert max(rank["value"][k] for k in ("image", "text", "scale")) < 1e-5, (b, rank)
            # clip: the student's scale sits above CLIP's clamp at 100, so it gets no gradient
            assert (rank["value"]["scale_grad"] == 0) == (loss == "clip")


def test_distill_loss_is_zero_gradient_at_the_teacher_and_uses_each_scale():
    """Student = teacher (same features and scale): the soft cross-entropy is at its minimum, the
    entropy of the targets, so the features' gradient vanishes; another teacher scale moves it."""
    image, text = (x.requires_grad_() for x in _features(5, 8, seed=0))
    scale = torch.tensor([2.0])
    value = distill_loss(image, text, scale, image.detach(), text.detach(), torch.tensor(2.0))
    grads = torch.autograd.grad(value, [image, text])
    assert max(g.abs().max().item() for g in grads) < 1e-6
    assert distill_loss(image, text, scale, image.detach(), text.detach(), torch.tensor(1.0)).item() != \
        pytest.approx(value.item(), rel=1e-3)
    one = distill_loss_global(image, text, scale, image.detach(), text.detach(), torch.tensor(2.0))
    assert one.item() == pytest.approx(value.item(), rel=1e-6)


# --------------------------------------------------------------------------- a training step

def _step_on_rank(rank: int, world: int, loss: str, k: int, b: int) -> dict:
    """One step of micro_batch_step / global_optimizer_step with a teacher on this rank's rows, gradients
    averaged as DeepSpeed does; rank 0 compares with one process on the whole batch."""
    import torch.distributed as dist

    from rsclip_ds.losses import LOSSES, build_loss
    from rsclip_ds.model import new_dual_encoder, preset_config
    from rsclip_ds.loop import micro_batch_step, global_optimizer_step
    from tests.helpers import LocalEngine

    n, config = world * k * b, preset_config("tiny")
    g = torch.Generator().manual_seed(0)
    data = {"pixel_values": torch.randint(0, 256, (n, 3, 64, 64), dtype=torch.uint8, generator=g),
            "input_ids": torch.randint(0, 1000, (n, 48), generator=g),
            "teacher_pixel_values": torch.randint(0, 256, (n, 3, TEACHER_SIZE, TEACHER_SIZE), dtype=torch.uint8,
                                                  generator=g),
            "teacher_input_ids": torch.randint(0, 1000, (n, 24), generator=g)}
    mine = {key: v[rank * k * b:(rank + 1) * k * b] for key, v in data.items()}
    micro = [{key: v[i * b:(i + 1) * b] for key, v in mine.items()} for i in range(k)]
    teacher, weight = _teacher(), 0.7
    engine = LocalEngine(new_dual_encoder(config, loss, seed=1))
    loss_fn = build_loss(loss, negatives="global", rank=rank, world_size=world)
    distiller = Distiller(teacher, weight, loss, rank, world)
    if k == 1:
        value = micro_batch_step(engine, micro[0], loss_fn, torch.float32, distiller)
    else:
        value = global_optimizer_step(engine, micro, loss_fn, torch.float32, distiller)
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    for grad in grads:
        dist.all_reduce(grad)
        grad /= world
    total = value.clone()
    dist.all_reduce(total)
    if rank:
        return {}
    reference = new_dual_encoder(config, loss, seed=1)
    image, text, scale, bias = reference(data["pixel_values"], data["input_ids"])
    t_image, t_text, t_scale = teacher(data["teacher_pixel_values"], data["teacher_input_ids"])
    ref = LOSSES[loss](image, text, scale, bias) + weight * distill_loss(image, text, scale, t_image, t_text,
                                                                         t_scale, loss=loss)
    ref.backward()
    diffs = [(got - r.grad).abs().max().item() for got, r in zip(grads, (r for r in reference.parameters()
                                                                           if r.grad is not None))]
    return {"loss": [total.item() / world, ref.item()], "grad": max(diffs), "n": len(diffs),
            "scale_grad": reference.logit_scale.grad.abs().item()}


@pytest.mark.parametrize("loss,k", [("clip", 1), ("siglip", 3)], ids=["clip-plain", "siglip-global-k3"])
def test_distillation_step_on_two_ranks_equals_one_process(loss, k, tmp_path):
    """Plain (one micro-batch per step) and 'global' accumulation (teacher once per micro-batch in
    the no-grad pass): loss and every gradient equal the single-process big batch's."""
    ranks = run_ranks(_step_on_rank, 2, tmp_path, loss, k, 3)
    assert all("error" not in r for r in ranks), [r.get("traceback") for r in ranks]
    got = ranks[0]["value"]
    assert got["loss"][0] == pytest.approx(got["loss"][1], rel=1e-5)
    assert got["n"] > 30 and got["grad"] < 2e-5, got
    assert got["scale_grad"] > 0   # the distillation term reaches the student's temperature


def test_teacher_is_frozen_and_runs_once_per_micro_batch_with_global_accumulation():
    from rsclip_ds.losses import siglip_loss
    from rsclip_ds.model import new_dual_encoder, preset_config
    from rsclip_ds.loop import global_optimizer_step
    from tests.helpers import LocalEngine

    teacher, calls = _teacher(), []
    teacher.register_forward_hook(lambda *_: calls.append(1))
    teacher.train()
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    g = torch.Generator().manual_seed(0)
    batches = [{"pixel_values": torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8, generator=g),
                "input_ids": torch.randint(0, 1000, (2, 48), generator=g),
                "teacher_pixel_values": torch.randint(0, 256, (2, 3, 48, 48), dtype=torch.uint8, generator=g),
                "teacher_input_ids": torch.randint(0, 1000, (2, 24), generator=g)} for _ in range(3)]
    engine = LocalEngine(new_dual_encoder(preset_config("tiny"), seed=1))
    global_optimizer_step(engine, batches, siglip_loss, torch.float32, Distiller(teacher, 1.0, "siglip"))
    assert len(calls) == 3 and all(p.grad is None for p in teacher.parameters())


# --------------------------------------------------------------------------- folder, loader, config

@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_shards):
    """A teacher folder with its own tokenizer (another vocabulary than the student's)."""
    from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer
    from rsclip_ds.model import new_dual_encoder, save_pretrained

    urls = [str(tiny_shards["dir"] / s["url"]) for s in tiny_shards["train"]]
    # trained on the captions spelled backwards: other merges, other ids than the student's
    tok = train_tokenizer((c[::-1] for c in iter_captions(urls)), tmp_path_factory.mktemp("teacher_tok"),
                          vocab_size=200, max_length=24)
    folder = tmp_path_factory.mktemp("teacher")
    model = new_dual_encoder(_teacher_config(vocab=len(tok)), seed=4)
    save_pretrained(model, tok, folder, mean=(0.4, 0.5, 0.6), std=(0.2, 0.3, 0.4))
    return folder


def test_teacher_folder_loads_frozen_with_its_own_inputs(teacher_dir):
    from rsclip_ds.model import load_tokenizer

    teacher, inputs = load_teacher(DistillConfig(teacher=str(teacher_dir), dtype="bf16"), device="cpu", on_gpu=False)
    assert (inputs.image_size, inputs.max_text_length) == (TEACHER_SIZE, 24)
    assert inputs.tokenizer.get_vocab() == load_tokenizer(teacher_dir).get_vocab()
    assert teacher.image_mean == (0.4, 0.5, 0.6) and teacher.dtype() == torch.bfloat16
    assert not any(p.requires_grad for p in teacher.parameters())
    image, text, _ = teacher(torch.zeros(2, 3, 48, 48, dtype=torch.uint8), torch.ones(2, 24, dtype=torch.long))
    assert image.shape == (2, 96) and not image.requires_grad


def _zero3_teacher_on_rank(rank: int, world: int, folder: str, port: int) -> dict:
    """The teacher partitioned over the ranks (its own ZeRO-3 inference engine) against the same
    teacher replicated: this rank's share of its weights, and the embeddings of one batch."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ds_config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    engine, _ = load_teacher(DistillConfig(teacher=folder, placement="zero3"), device="cpu", on_gpu=False,
                             ds_config=ds_config)
    whole, _ = load_teacher(DistillConfig(teacher=folder), device="cpu", on_gpu=False)
    params = list(engine.module.parameters())
    g = torch.Generator().manual_seed(rank)
    pixels = torch.randint(0, 256, (2, 3, TEACHER_SIZE, TEACHER_SIZE), dtype=torch.uint8, generator=g)
    ids = torch.randint(0, 100, (2, 24), generator=g)
    got, want = Distiller(engine, 1.0, "siglip"), Distiller(whole, 1.0, "siglip")
    diffs = [(a - b).abs().max().item() for a, b in zip(got.targets({"teacher_pixel_values": pixels,
                                                                     "teacher_input_ids": ids}, "cpu"),
                                                       want.targets({"teacher_pixel_values": pixels,
                                                                     "teacher_input_ids": ids}, "cpu"))]
    return {"held": sum(p.ds_tensor.numel() for p in params), "total": sum(p.ds_numel for p in params),
            "local": sum(p.numel() for p in params), "diff": max(diffs),
            "scale": [got.logit_scale.item(), want.logit_scale.item()], "frozen": not any(p.requires_grad for p in params)}


@pytest.mark.slow
def test_zero3_placement_partitions_the_teacher_and_gives_its_embeddings(teacher_dir, tmp_path):
    import socket

    import deepspeed  # noqa: F401 -- imported once here, not in every forked rank

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = run_ranks(_zero3_teacher_on_rank, 2, tmp_path, str(teacher_dir), port)
    assert all("error" not in r for r in ranks), [r.get("traceback") for r in ranks]
    for r in ranks:
        got = r["value"]
        assert got["local"] == 0 and got["frozen"]          # nothing but partitions outside the forward
        assert got["held"] <= got["total"] // 2 + 2 * 48   # 1/2 each, up to padding per parameter
        assert got["diff"] < 1e-6 and got["scale"][0] == got["scale"][1]
    assert ranks[0]["value"]["held"] + ranks[1]["value"]["held"] >= ranks[0]["value"]["total"]


def test_loader_emits_both_models_inputs_from_the_same_view(tiny_shards, tiny_tokenizer, teacher_dir):
    from rsclip_ds.data import build_train_loader
    from rsclip_ds.data.tokenizer import tokenize
    from rsclip_ds.data.transforms import resize_bicubic_fast
    from rsclip_ds.model import load_tokenizer

    cfg = DataConfig(train_shards=tiny_shards["train_pattern"], num_workers=0, shuffle_buffer=8, hflip=True,
                     random_resized_crop=(0.3, 1.0))
    spec = TeacherInputs(load_tokenizer(teacher_dir), TEACHER_SIZE, 24)
    loader = build_train_loader(cfg, tokenizer=tiny_tokenizer, image_size=32, max_text_length=40, micro_batch_size=4,
                                rank=0, world_size=1, seed=0, return_keys=True, teacher=spec)
    batch = next(iter(loader))
    assert batch["pixel_values"].shape == (4, 3, 32, 32) and batch["input_ids"].shape == (4, 40)
    assert batch["teacher_pixel_values"].shape == (4, 3, 48, 48) and batch["teacher_input_ids"].shape == (4, 24)
    for student, teacher in zip(batch["pixel_values"], batch["teacher_pixel_values"]):   # the same crop and flip
        again = resize_bicubic_fast(teacher.permute(1, 2, 0).contiguous().numpy(), 32)
        assert (torch.from_numpy(again).permute(2, 0, 1) == student).all()
    plain = build_train_loader(cfg, tokenizer=tiny_tokenizer, image_size=32, max_text_length=40, micro_batch_size=4,
                               rank=0, world_size=1, seed=0, return_keys=True)
    other = next(iter(plain))
    assert "teacher_pixel_values" not in other and other["keys"] == batch["keys"]
    # the captions drawn are the same; the teacher's ids are its tokenizer's, not the student's
    assert (batch["input_ids"] == other["input_ids"]).all()
    captions = tiny_tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)
    assert (batch["teacher_input_ids"] == tokenize(spec.tokenizer, captions, 24)).all()
    assert not (batch["teacher_input_ids"] == tokenize(tiny_tokenizer, captions, 24)).all()
    assert loader.batch_bytes == 4 * (3 * 32 * 32 + 3 * 48 * 48 + 8 * (40 + 24))


def test_config_refusals_name_the_fix(tmp_path, teacher_dir):
    check_distill(DistillConfig(), 2)
    check_distill(DistillConfig(teacher=str(teacher_dir)), 2)
    with pytest.raises(ConfigError, match="no such folder"):
        check_distill(DistillConfig(teacher=str(tmp_path / "missing" / "x" / "y")), 2)
    with pytest.raises(ConfigError, match="no config.json"):
        check_distill(DistillConfig(teacher=str(tmp_path)), 2)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ConfigError, match="not a dual encoder"):
        check_distill(DistillConfig(teacher=str(tmp_path)), 2)
    with pytest.raises(ConfigError, match="profile=zero3"):
        check_distill(DistillConfig(teacher=str(teacher_dir), placement="zero3"), 2)
    check_distill(DistillConfig(teacher=str(teacher_dir), placement="zero3"), 3)
    (tmp_path / "config.json").write_text('{"model_type": "clip"}')
    check_distill(DistillConfig(teacher=str(tmp_path)), 2)
    with pytest.raises(ConfigError, match="placement=replicated"):
        check_distill(DistillConfig(teacher=str(tmp_path), placement="zero3"), 3)
    with pytest.raises(ConfigError, match="distill.teacher is not"):
        check_distill(DistillConfig(weight=0.5, dtype="bf16"), 2)


# --------------------------------------------------------------------------- the planner

def test_planner_counts_the_teacher():
    """A git-rsclip-large teacher of a base student: its bf16 weights (all of them, or 1/G under
    zero3 placement), its inputs and embeddings beside the student's, its forward FLOPs per sample."""
    from rsclip_ds.model import preset_config
    from rsclip_ds.planning.flops import flops_per_sample
    from rsclip_ds.planning.memory import GiB, peak, preset_spec
    from rsclip_ds.planning.planner import Budget, Hardware, plan
    from rsclip_ds.planning.teacher import forward_bytes, teacher_plan, weight_bytes, with_teacher
    from rsclip_ds.profiles import load_profile

    student, teacher = preset_spec("git-rsclip-base"), teacher_plan("git-rsclip-large")
    assert 640e6 < teacher.spec.params < 660e6
    base = peak(student, load_profile("zero2"), "bf16", 8, 8, micro=32)
    got = with_teacher(base, teacher, 8, 32)
    assert got.states - base.states == 2 * teacher.spec.params
    assert got.inputs - base.inputs == 32 * (3 * 256 ** 2 + 8 * 64) + 32 * 2 * 4 * 1024
    assert got.activations == max(base.activations, forward_bytes(teacher, 32))
    assert weight_bytes(teacher_plan("git-rsclip-large", placement="zero3"), 8) == -(-2 * teacher.spec.params // 8)
    assert weight_bytes(teacher_plan("git-rsclip-large", dtype="fp32"), 8) == 4 * teacher.spec.params

    budget, hw = Budget(8, 1, 16 * GiB), Hardware()
    rows = {(r.profile, r.checkpointing): r for r in plan(student, budget, 8192, profiles=["zero2"],
                                                          accumulation="plain")}
    with_t = {(r.profile, r.checkpointing): r for r in plan(student, budget, 8192, profiles=["zero2"],
                                                            accumulation="plain", teacher=teacher)}
    per_sample = flops_per_sample(preset_config("git-rsclip-large")).forward
    for key, row in rows.items():
        assert with_t[key].compute_s - row.compute_s == pytest.approx(per_sample * 1024 / hw.flops, rel=1e-9)
        assert with_t[key].max_micro <= row.max_micro
    assert any(with_t[k].max_micro < r.max_micro for k, r in rows.items())
    assert all(with_t[k].comm_s == r.comm_s for k, r in rows.items())   # replicated: no traffic of its own

    from rsclip_ds.planning.comms import comm_time
    from rsclip_ds.planning.planner import step_time
    from rsclip_ds.planning.teacher import traffic

    parted = teacher_plan("git-rsclip-large", placement="zero3")
    zero3 = load_profile("zero3")
    alone, taught = (step_time(student, zero3, "bf16", False, 32, 4, budget, teacher=t) for t in (None, parted))
    gathers = traffic(parted, 4)
    assert gathers[0].size == 4 * 2 * teacher.spec.params and gathers[0].op == "all_gather"
    assert taught.comm.total_s - alone.comm.total_s == pytest.approx(comm_time(gathers, 1, 8).total_s, rel=1e-9)


def test_plan_takes_a_teacher(capsys):
    """`rsclip-ds plan --set distill.teacher=git-rsclip-large`: a smaller micro-batch fits, the step
    computes more, and the launch command carries the setting."""
    base = ["plan", "--model", "git-rsclip-base", "--gpus", "8", "--gpu-mem", "16GiB", "--global-batch", "8192",
            "--json"]

    def planned(*sets):
        return planned_zero2(capsys, base, *sets)

    (_, alone), (doc, taught) = planned(), planned("distill.teacher=git-rsclip-large")
    assert taught["max_micro"] < alone["max_micro"] and taught["compute_s"] > 1.5 * alone["compute_s"]
    assert "--set distill.teacher=git-rsclip-large" in doc["command"]
