"""Vision-language rows: the trainer's logprobs are those of the model's own unpacked forward.

A tiny random Qwen2-VL (fixture tiny_vl_model_path), Qwen2.5-VL or Idefics3 (SmolVLM; images split
into tiles plus a global view): prompts with one or two images of different
sizes, text before and after them, groups of completions packed one after another (plain) or
hanging from one copy of their prompt and its images (shared prefix). The reference is
Qwen2VLForConditionalGeneration's forward of each rollout alone (its own get_rope_index M-RoPE
positions, its own placeholder scatter), in float32. For Idefics3 the reference takes the HF
processor's own ids, tiled pixel_values and pixel_attention_mask, so the prompter's expansion and
its tiles-as-patches layout are checked as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import grpo.trainer.hf.model as trainer_model
from grpo.orchestrator.batching.packer import pack_rollouts
from grpo.orchestrator.images.prompts import image_prompter_of
from grpo.orchestrator.images.tiles import TiledImagePrompter
from grpo.orchestrator.types import Rollout
from grpo.trainer.hf.trainer import Trainer
from grpo.transport.batches.batch import PackedRow, SamplingTruncation, TrainingBatch, plain_parent_ids
from grpo.transport.batches.images import RowImages
from grpo.transport.batches.wire import decode_batch, encode_batch
from grpo.utils.errors import UserError

TEXT_VOCAB = 49152  # SmolLM2's own tokens; the vision tokens come after


@dataclass
class Prompt:
    ids: list[int]
    images: RowImages
    processor_inputs: dict[str, np.ndarray] | None = None
    """Idefics3: the HF processor's own input_ids, pixel_values and pixel_attention_mask."""


@dataclass
class Sample:
    prompt: Prompt
    completion: list[int]
    temperature: float


def _prompt(model_path: Path, parts: list[object]) -> Prompt:
    """A user turn of image and text parts (a PIL image or a string), as the orchestrator renders it."""
    from PIL import Image

    content = [
        {"type": "image", "image": p} if isinstance(p, Image.Image) else {"type": "text", "text": p}
        for p in parts
    ]
    messages = [{"role": "user", "content": content}]
    prompter = image_prompter_of(str(model_path))
    prompt = prompter.prompt(messages)
    ids, images = prompt.ids, prompt.images
    assert images is not None
    if not isinstance(prompter, TiledImagePrompter):
        return Prompt(ids, images)
    text = prompter.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images_in = [p for p in parts if isinstance(p, Image.Image)]
    inputs = prompter.processor(
        text=[text], images=[images_in], add_special_tokens=False, return_tensors="np"
    )
    assert inputs["input_ids"][0].tolist() == ids  # the processor's own expansion
    return Prompt(ids, images, {k: np.asarray(v) for k, v in inputs.items()})


def _samples(model_path: Path) -> list[Sample]:
    from PIL import Image, ImageDraw

    red = Image.new("RGB", (60, 60), "white")
    ImageDraw.Draw(red).ellipse((10, 10, 40, 40), fill="red")
    wide = Image.new("RGB", (100, 60), "blue")
    tall = Image.new("RGB", (60, 110), "green")
    prompts = [
        _prompt(model_path, [red, "How many red circles?"]),
        _prompt(model_path, ["Compare", wide, "with", tall, "in one word."]),
    ]
    rng = np.random.default_rng(0)
    samples = []
    for prompt, temperature in zip(prompts, [1.0, 0.7], strict=True):
        for _ in range(3):
            completion = rng.integers(0, TEXT_VOCAB, int(rng.integers(2, 7))).tolist()
            samples.append(Sample(prompt, completion, temperature))
    return samples


def _arrays(num_tokens: int, loss_mask: np.ndarray, temperatures: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "loss_mask": loss_mask,
        "advantages": np.where(loss_mask, 0.5, 0.0).astype(np.float32),
        "inference_logprobs": np.where(loss_mask, -10.0, 0.0).astype(np.float32),
        "temperatures": temperatures.astype(np.float32),
    }


def _plain_row(samples: list[Sample]) -> PackedRow:
    ids, mask, temps, positions, image_parts = [], [], [], [], []
    for sample in samples:
        image_parts.append((sample.prompt.images, len(ids)))
        n_prompt, n_completion = len(sample.prompt.ids), len(sample.completion)
        ids += sample.prompt.ids + sample.completion
        mask += [False] * n_prompt + [True] * n_completion
        temps += [1.0] * n_prompt + [sample.temperature] * n_completion
        positions += list(range(n_prompt + n_completion))
    position_ids = np.array(positions, np.int32)
    return PackedRow(
        input_ids=np.array(ids, np.int32),
        position_ids=position_ids,
        parent_ids=plain_parent_ids(position_ids),
        images=RowImages.concat(image_parts),
        **_arrays(len(ids), np.array(mask), np.array(temps)),
    )


def _shared_row(groups: list[list[Sample]]) -> PackedRow:
    """Each group's prompt (and its images) once, every completion hanging from its last token."""
    ids, mask, temps, positions, parents, image_parts = [], [], [], [], [], []
    for group in groups:
        prompt = group[0].prompt
        start = len(ids)
        image_parts.append((prompt.images, start))
        ids += prompt.ids
        mask += [False] * len(prompt.ids)
        temps += [1.0] * len(prompt.ids)
        positions += list(range(len(prompt.ids)))
        parents += [-1, *range(start, start + len(prompt.ids) - 1)]
        last = len(ids) - 1
        for sample in group:
            for k, token in enumerate(sample.completion):
                parents.append(last if k == 0 else len(ids) - 1)
                ids.append(token)
                mask.append(True)
                temps.append(sample.temperature)
                positions.append(len(prompt.ids) + k)
    return PackedRow(
        input_ids=np.array(ids, np.int32),
        position_ids=np.array(positions, np.int32),
        parent_ids=np.array(parents, np.int32),
        images=RowImages.concat(image_parts),
        **_arrays(len(ids), np.array(mask), np.array(temps)),
    )


def _reference_logprobs(causal_lm: torch.nn.Module, sample: Sample, image_token_id: int) -> np.ndarray:
    """The model's own forward of one rollout: logprobs of its completion tokens."""
    device = next(causal_lm.parameters()).device  # the trainer's (CUDA on a GPU machine)
    ids = torch.tensor([sample.prompt.ids + sample.completion], device=device)
    hf = sample.prompt.processor_inputs
    with torch.no_grad():
        if hf is not None:
            logits = causal_lm(
                input_ids=ids,
                pixel_values=torch.from_numpy(hf["pixel_values"]).to(device),
                pixel_attention_mask=torch.from_numpy(hf["pixel_attention_mask"]).to(device),
            ).logits[0]
        else:
            logits = causal_lm(
                input_ids=ids,
                pixel_values=torch.from_numpy(sample.prompt.images.pixel_values).to(device),
                image_grid_thw=torch.from_numpy(sample.prompt.images.grid_thw.astype(np.int64)).to(device),
                mm_token_type_ids=(ids == image_token_id).int(),
            ).logits[0]
    n_prompt = len(sample.prompt.ids)
    predicting = logits[n_prompt - 1 : -1].float().cpu() / sample.temperature
    logprobs = torch.log_softmax(predicting, dim=-1)
    return logprobs.gather(-1, torch.tensor(sample.completion)[:, None])[:, 0].numpy()


def _float32_trainer(make_cfg, model_path, tmp_path, monkeypatch, **overrides) -> Trainer:
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.float32)
    trainer = Trainer(make_cfg(model=str(model_path), **overrides), tmp_path)
    torch.manual_seed(0)
    for name, param in trainer.policy.model.named_parameters():
        if "lora_B" in name:  # B starts at zero: make the adapters count
            torch.nn.init.normal_(param, std=0.05)
    return trainer


@pytest.mark.parametrize(
    ("family", "lora"),
    [("qwen2_vl", True), ("qwen2_vl", False), ("qwen2_5_vl", True), ("idefics3", True), ("idefics3", False)],
    ids=["qwen2-vl-lora", "qwen2-vl-full", "qwen2.5-vl-lora", "idefics3-lora", "idefics3-full"],
)
def test_trainer_logprobs_of_image_rows_equal_the_models_unpacked_forward_plain_and_shared(
    make_cfg, request, tmp_path, monkeypatch, family, lora
):
    fixture = {
        "qwen2_vl": "tiny_vl_model_path",
        "qwen2_5_vl": "tiny_qwen25_vl_model_path",
        "idefics3": "tiny_idefics3_model_path",
    }[family]
    model_path = request.getfixturevalue(fixture)
    trainer = _float32_trainer(make_cfg, model_path, tmp_path, monkeypatch, lora=lora)
    assert trainer.policy.vision is not None
    assert trainer.policy.causal_lm.config.model_type == family
    samples = _samples(model_path)
    expected = np.concatenate(
        [
            _reference_logprobs(trainer.policy.causal_lm, s, trainer.policy.vision.image_token_id)
            for s in samples
        ]
    )
    plain = [_plain_row(samples[:4]), _plain_row(samples[4:])]  # a row holds both kinds of prompt
    shared = [_shared_row([samples[:3], samples[3:]])]
    for rows in (plain, shared):
        got = np.concatenate([lp[row.loss_mask] for row, lp in zip(rows, trainer.score(rows), strict=True)])
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


def _rollouts(samples: list[Sample]) -> list[Rollout]:
    return [
        Rollout(
            env_name="e",
            example_index=i // 3,
            prompt_ids=list(s.prompt.ids),
            completion_ids=list(s.completion),
            completion_mask=[True] * len(s.completion),
            completion_logprobs=[
                -10.0 - 0.01 * (10 * i + k) for k in range(len(s.completion))
            ],  # unique keys
            temperature=s.temperature,
            start_version=0,
            end_version=0,
            advantage=0.5,
            prompt_images=s.prompt.images,
        )
        for i, s in enumerate(samples)
    ]


def test_the_packers_image_rows_give_the_models_unpacked_logprobs_plain_and_shared(
    make_cfg, tiny_vl_model_path, tmp_path, monkeypatch
):
    trainer = _float32_trainer(make_cfg, tiny_vl_model_path, tmp_path, monkeypatch)
    assert trainer.policy.vision is not None
    samples = _samples(tiny_vl_model_path)
    image_token = trainer.policy.vision.image_token_id
    expected = [_reference_logprobs(trainer.policy.causal_lm, s, image_token) for s in samples]
    rollouts = _rollouts(samples)
    for share_prefixes in (False, True):
        rows, _ = pack_rollouts(rollouts, seq_len=512, share_prefixes=share_prefixes)
        num_images = sum(r.images.num_images for r in rows if r.images is not None)
        assert num_images == (3 if share_prefixes else 9)  # prompts of 1 and 2 images, 3 rollouts each
        got = {}  # each loss token's trainer logprob, keyed by its (unique) inference logprob
        for row, logprobs in zip(rows, trainer.score(rows), strict=True):
            for key, value in zip(
                row.inference_logprobs[row.loss_mask], logprobs[row.loss_mask], strict=True
            ):
                got[round(float(key), 4)] = float(value)
        for rollout, want in zip(rollouts, expected, strict=True):
            trained = [got[round(key, 4)] for key in rollout.completion_logprobs]
            np.testing.assert_allclose(trained, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "fixture", ["tiny_vl_model_path", "tiny_idefics3_model_path"], ids=["qwen2-vl", "idefics3"]
)
def test_image_rows_train_the_language_model_and_leave_the_vision_tower_frozen(
    make_cfg, request, tmp_path, monkeypatch, fixture
):
    from grpo.trainer.hf.vision import vision_modules

    model_path = request.getfixturevalue(fixture)
    trainer = _float32_trainer(make_cfg, model_path, tmp_path, monkeypatch, lora=False)
    samples = _samples(model_path)
    tower = torch.nn.ModuleList(vision_modules(trainer.policy.causal_lm))
    before = {n: p.detach().clone() for n, p in tower.named_parameters()}
    decoder_weight = trainer.policy.causal_lm.get_decoder().layers[0].mlp.down_proj.weight
    decoder_before = decoder_weight.detach().clone()
    batch = TrainingBatch(
        step=0, rows=[_shared_row([samples[:3], samples[3:]])], sampling=SamplingTruncation()
    )
    metrics = trainer.train_step(batch)
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert all(not p.requires_grad for p in tower.parameters())
    assert all(torch.equal(p, before[n]) for n, p in tower.named_parameters())
    assert not torch.equal(decoder_weight, decoder_before)


@pytest.mark.parametrize(
    ("fixture", "language_model"),
    [("tiny_vl_model_path", ".language_model."), ("tiny_idefics3_model_path", ".text_model.")],
    ids=["qwen2-vl", "idefics3"],
)
def test_lora_on_a_vision_language_model_adapts_the_language_model_only(
    make_cfg, request, tmp_path, monkeypatch, fixture, language_model
):
    model_path = request.getfixturevalue(fixture)
    trainer = _float32_trainer(
        make_cfg, model_path, tmp_path, monkeypatch, lora_target_modules=["all-linear"]
    )
    adapted = {
        n.rsplit(".lora_", 1)[0] for n, p in trainer.policy.model.named_parameters() if p.requires_grad
    }
    assert adapted and all(language_model in n for n in adapted)


def test_image_rows_cross_the_wire_and_decode_to_the_same_images(tiny_vl_model_path):
    samples = _samples(tiny_vl_model_path)
    row = _shared_row([samples[:3], samples[3:]])
    batch = TrainingBatch(step=3, rows=[row, _plain_row(samples[:1])])
    decoded = decode_batch(encode_batch(batch))
    for sent, got in zip(batch.rows, decoded.rows, strict=True):
        assert sent.images is not None and got.images is not None
        for name in ("pixel_values", "grid_thw", "token_starts"):
            np.testing.assert_array_equal(getattr(got.images, name), getattr(sent.images, name))


def test_train_vision_tower_with_lora_is_refused_at_load(make_cfg, tiny_vl_model_path, tmp_path):
    with pytest.raises(UserError, match="train_vision_tower needs lora: false"):
        Trainer(make_cfg(model=str(tiny_vl_model_path), train_vision_tower=True), tmp_path)


def test_image_rows_for_a_text_model_are_refused(make_cfg, tiny_vl_model_path, tmp_path):
    trainer = Trainer(make_cfg(), tmp_path)
    row = _plain_row(_samples(tiny_vl_model_path)[:1])
    row.input_ids = np.minimum(row.input_ids, 400).astype(np.int32)
    with pytest.raises(ValueError, match="text-only"):
        trainer.score([row])


def test_vision_language_families_not_verified_are_refused_by_name() -> None:
    from types import SimpleNamespace

    from grpo.trainer.hf.vision import is_vision_language, vision_tokens_for

    gemma3 = SimpleNamespace(model_type="gemma3", vision_config=SimpleNamespace(), image_token_id=5)
    assert is_vision_language(gemma3)
    with pytest.raises(UserError, match="gemma3 is a vision-language model the trainer does not support"):
        vision_tokens_for(gemma3)
