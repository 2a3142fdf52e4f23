"""Preference objectives (issue 71): DPO, IPO and SimPO from the answers' log-probabilities, held to
TRL's own code on the same policy and reference log-probabilities; answers packed in one row kept
apart."""

from __future__ import annotations

import json
import math
import random
import tomllib
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from distributed import run_ranks
from helpers import (
    CONFIGS,
    REPO,
    SGD,
    Crash,
    assert_same_training,
    assert_states_close,
    crash_at,
    gpt_tiny,
    in_process,
    losses,
    read_records,
    shardwise,
    train_in_process,
)
from safetensors.torch import load_file

from shardwise.config.schema import ConfigError
from shardwise.data import make_datasets
from shardwise.data.pairs import PairWindows
from shardwise.data.samples import IGNORED
from shardwise.preference import NO_ANSWER, PairLogps, pair_logps, preference_loss
from shardwise.trackers import REWARDS
from shardwise.trainer import Trainer

PAIRS, LENGTH, BETA, GAMMA = 6, 12, 0.1, 0.5


def answers_and_logps(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's layout: [chosen rows; rejected rows] of LENGTH + 1 tokens, a prompt then an answer of
    2 to 8 tokens then padding; each predicted token's log-probability (0 outside answers); and the
    reference's log-probability of each answer."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * PAIRS, LENGTH + 1, dtype=torch.long)
    for row in range(2 * PAIRS):
        start = int(torch.randint(1, 4, (), generator=generator))
        mask[row, start : start + int(torch.randint(2, 9, (), generator=generator))] = 1
    logps = -torch.rand(2 * PAIRS, LENGTH, generator=generator, dtype=torch.float64).float() * 3 * mask[:, 1:]
    reference = logps.sum(1) + torch.randn(2 * PAIRS, generator=generator) * 0.5
    return mask, logps, reference[:PAIRS], reference[PAIRS:]


def ours(objective: str, mask: torch.Tensor, logps: torch.Tensor, ref_chosen: torch.Tensor,
         ref_rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    sums, counts = logps.sum(1), mask.sum(1).float()
    policy = PairLogps(sums[:PAIRS], sums[PAIRS:], counts[:PAIRS], counts[PAIRS:])
    reference = PairLogps(ref_chosen, ref_rejected, counts[:PAIRS], counts[PAIRS:])
    losses, metrics = preference_loss(objective, BETA, GAMMA, policy, None if objective == "simpo" else reference)
    return losses.mean(), metrics.record()


def trl_dpo(loss_type: str, mask: torch.Tensor, logps: torch.Tensor, ref_chosen: torch.Tensor,
            ref_rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """DPOTrainer._compute_loss itself, on a stand-in model returning `logps` as its per-token
    log-probabilities and the reference's precomputed (TRL's precompute_ref_log_probs)."""
    from trl import DPOTrainer

    class Model(torch.nn.Module):
        def forward(self, **kwargs: object) -> SimpleNamespace:
            zeros = torch.zeros_like(logps)
            return SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    model = Model()
    metrics: defaultdict = defaultdict(lambda: defaultdict(list))
    trainer = SimpleNamespace(
        model=model, accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t,
                                                 gather_for_metrics=lambda t: t),
        ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
        loss_weights=[1.0], beta=BETA, aux_loss_enabled=False, _metrics=metrics, _total_train_tokens=0, _tp_size=1,
        use_weighting=False, label_smoothing=0.0)
    inputs = {"input_ids": torch.ones_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    return loss, {key: metrics["train"][f"rewards/{name}"][0] for key, name in (
        ("reward_chosen", "chosen"), ("reward_rejected", "rejected"), ("reward_accuracy", "accuracies"),
        ("reward_margin", "margins"))}


def trl_simpo(mask: torch.Tensor, logps: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """CPOTrainer.cpo_loss itself (loss_type "simpo", cpo_alpha 0: the loss is the mean of its
    losses), on the answers' mean log-probabilities (its get_batch_logps' average_log_prob), and the
    metrics as its get_batch_loss_metrics computes them."""
    from trl.experimental.cpo import CPOTrainer

    average = logps.sum(1) / mask.sum(1)
    trainer = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=GAMMA, beta=BETA, label_smoothing=0.0,
                              accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, chosen, rejected = CPOTrainer.cpo_loss(trainer, average[:PAIRS], average[PAIRS:])
    return losses.mean(), {"reward_chosen": chosen.mean().item(), "reward_rejected": rejected.mean().item(),
                           "reward_accuracy": (chosen > rejected).float().mean().item(),
                           "reward_margin": (chosen - rejected).mean().item()}


@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo"])
def test_losses_and_reward_metrics_equal_trls(objective):
    for seed in range(3):
        data = answers_and_logps(seed)
        got, got_metrics = ours(objective, *data)
        want, want_metrics = trl_simpo(*data[:2]) if objective == "simpo" else \
            trl_dpo({"dpo": "sigmoid", "ipo": "ipo"}[objective], *data)
        assert got.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-7)
        assert got_metrics == pytest.approx(want_metrics, rel=1e-6, abs=1e-7)
        assert 0 < got_metrics["reward_accuracy"] < 1 or objective == "simpo"  # the pairs disagree: a real check


def test_answers_packed_in_one_row_keep_their_own_log_probabilities():
    """Two pairs in one row and one in the next: each answer's sum is its own tokens' alone, as if
    computed one answer at a time; tokens no answer counts (prompts, padding) count nowhere."""
    torch.manual_seed(0)
    logits = torch.randn(2, 10, 7)
    targets = torch.randint(0, 7, (2, 10))
    answers = torch.full((2, 10), NO_ANSWER)
    spans = {(0, 0): (1, 3), (0, 1): (4, 5), (0, 2): (6, 8), (0, 3): (8, 10), (1, 0): (2, 6), (1, 1): (7, 9)}
    for (row, answer), (start, stop) in spans.items():
        answers[row, start:stop] = answer
    got, where = pair_logps(logits, targets, answers)
    assert where.tolist() == [[0, 0], [0, 1], [1, 0]]
    token = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    want = {key: token[key[0], start:stop].sum() for key, (start, stop) in spans.items()}
    order = [(0, 0), (0, 2), (1, 0)]  # each pair's chosen answer, row by row
    torch.testing.assert_close(got.chosen, torch.stack([want[k] for k in order]))
    torch.testing.assert_close(got.rejected, torch.stack([want[(r, a + 1)] for r, a in order]))
    assert got.chosen_tokens.tolist() == [2, 2, 4] and got.rejected_tokens.tolist() == [1, 2, 2]


# --- training on preference pairs ---------------------------------------------------------------

STEPS = 8
WORDS = ["sword", "crown", "night", "love", "king", "ghost", "storm", "rose", "fool", "heart", "moon", "war"]


def write_pairs(path: Path, count: int = 96) -> list[dict]:
    """Pairs whose chosen answer shouts the word the prompt names, the rejected one says it; prompts
    of 3 to 14 bytes, so that a 65-byte window holds one pair or two."""
    generator = random.Random(0)
    records = []
    for _ in range(count):
        word = generator.choice(WORDS)
        prompt = generator.choice([f"{word}?", f"Say {word}:", f"Shout {word} now:"])
        records.append({"prompt": prompt, "chosen": f" {word.upper()}!", "rejected": f" {word}."})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def pair_config(out: Path, strategy: str, world: int, *overrides: str, data: Path, steps: int = STEPS):
    return gpt_tiny(out, strategy, world, f"data.path={data}", "data.format=preference", "train.objective=dpo",
                    "data.pack_pairs=true", "train.warmup_steps=0", "train.min_lr=0.1", "train.micro_batch=4", *SGD,
                    *overrides, steps=steps)


def counted_answers(cfg) -> list[str]:
    """The answers whose tokens the windows' targets count, decoded, in order."""
    seen = []
    for dataset in make_datasets(cfg):
        inputs, targets = dataset.batch(torch.arange(len(dataset)))
        documents = dataset.documents(torch.arange(len(dataset)))
        assert inputs.shape == documents.shape == targets.shape[:2] == (len(dataset), cfg.model.seq_len)
        for row in range(len(dataset)):
            tokens, answers, windows = targets[row].unbind(-1)
            assert (windows == row + dataset.first_id).all() and ((tokens == IGNORED) == (answers == NO_ANSWER)).all()
            for slot in range(int(answers.max()) + 1):
                seen.append(bytes(tokens[answers == slot].tolist()).decode())
                # the input predicting each answer token is in the answer's own document (its prompt and
                # answer), apart from its pair's other answer and from the window's other pairs
                assert (documents[row][answers == slot] == slot).all()
            assert documents[row].diff().ge(0).all()  # documents follow one another
    return seen


def test_a_window_counts_exactly_its_pairs_answers(tmp_path):
    """Every pair of the file in a window, whole, in the file's order: the targets an answer counts
    are its own tokens (chosen, then rejected), its prompt repeated before each; nothing else counts."""
    records = write_pairs(tmp_path / "pairs.jsonl")
    cfg = pair_config(tmp_path / "run", "single", 1, data=tmp_path / "pairs.jsonl")
    train, val = make_datasets(cfg)
    assert isinstance(train, PairWindows) and len(train.lengths) + len(val.lengths) == len(records)
    assert train.most_pairs == 2 and len(train) < len(train.lengths)  # packed: some windows hold two
    assert counted_answers(cfg) == [r[key] for r in records for key in ("chosen", "rejected")]
    alone = pair_config(tmp_path / "run", "single", 1, "data.pack_pairs=false", data=tmp_path / "pairs.jsonl")
    train, val = make_datasets(alone)  # one pair a window: train.global_batch counts pairs
    assert (train.most_pairs, len(train), len(val)) == (1, len(train.lengths), len(val.lengths))
    assert counted_answers(alone) == [r[key] for r in records for key in ("chosen", "rejected")]


def test_the_shipped_pairs_count_exactly_their_answers(tmp_path):
    """configs/dpo-shout.toml's pairs (examples/preference/) in its windows: the tokens counted are the
    answers'. (Its data and window alone: its model.weights is `make demo`'s, not made here.)"""
    shipped = tomllib.loads((CONFIGS / "dpo-shout.toml").read_text())
    data, seq_len, held_out = (REPO / shipped["data"]["path"], shipped["model"]["seq_len"],
                               shipped["data"]["val_fraction"])
    cfg = pair_config(tmp_path, "single", 1, f"model.seq_len={seq_len}", f"data.val_fraction={held_out}", data=data)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    assert counted_answers(cfg) == [r[key] for r in records for key in ("chosen", "rejected")]


def preference_runs(ctx, root: Path, runs: dict, data: Path) -> None:
    for name, (strategy, *overrides) in runs.items():
        Trainer(pair_config(root / name, strategy, ctx.world_size, *overrides, data=data), ctx).fit()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    data = root / "pairs.jsonl"
    write_pairs(data)
    lora = ("lora.rank=4",)
    train_in_process(pair_config(root / "single", "single", 1, data=data))
    train_in_process(pair_config(root / "single-lora", "single", 1, *lora, data=data))
    train_in_process(pair_config(root / "single-simpo", "single", 1, "train.objective=simpo", data=data))
    train_in_process(pair_config(root / "single-copy", "single", 1, "train.reference=copy", data=data))
    two = {name: (name,) for name in ("ddp", "zero2", "fsdp", "pipeline")}
    two |= {"fsdp-lora": ("fsdp", *lora), "pipeline-lora": ("pipeline", *lora),
            "ddp-simpo": ("ddp", "train.objective=simpo"), "fsdp-copy": ("fsdp", "train.reference=copy")}
    run_ranks(preference_runs, 2, root, two, data)
    tp = ("parallel.tp=2", "train.micro_batch=2")
    run_ranks(preference_runs, 4, root, {"fsdp-tp2": ("fsdp", *tp), "fsdp-tp2-lora": ("fsdp", *tp, *lora)}, data)
    return root


@pytest.mark.parametrize("name", ["ddp", "zero2", "fsdp", "pipeline", "fsdp-tp2", "fsdp-lora", "pipeline-lora",
                                  "fsdp-tp2-lora", "ddp-simpo", "fsdp-copy"])
def test_preference_training_under_every_sharding_equals_single(trained, name):
    """DPO (SimPO where named) on 2 ranks (4 for fsdp over tp 2, micro-batches of 2 windows: a step's
    loss is the same whatever the micro-batches), with LoRA and without, SGD: every step's loss within
    1e-5 relative, the trained weights within rtol 1e-5, and the reward metrics logged."""
    single = {"lora": "single-lora", "simpo": "single-simpo"}.get(name.rpartition("-")[2], "single")
    assert_same_training(trained / name, trained / single, STEPS)
    got, want = read_records(trained / name), read_records(trained / single)
    for ours, theirs in zip(got, want, strict=True):
        assert ours["reward_margin"] == pytest.approx(theirs["reward_margin"], rel=1e-4, abs=1e-6)
    assert want[0]["loss"] == pytest.approx(math.log(2), rel=1e-6) or name.endswith("simpo")  # policy == reference
    assert want[-1]["reward_accuracy"] > 0.5 and want[-1]["reward_margin"] > want[0]["reward_margin"]


def test_a_frozen_copy_as_reference_trains_as_the_reference_pass_does(trained):
    """train.reference = "copy" (a frozen copy of the initial model computing each step's windows) gives
    the reference log-probabilities the pass before the first step gave: the same run, bit for bit."""
    assert losses(trained / "single-copy") == losses(trained / "single")
    assert not (trained / "single-copy" / "reference.safetensors").exists()
    (copy,), (alone,) = (read_records(trained / name, "summary") for name in ("single-copy", "single"))
    assert copy["memory"]["params"] == 2 * alone["memory"]["params"]  # the copy's parameters are counted
    got, want = (load_file(str(trained / name / "model.safetensors")) for name in ("single-copy", "single"))
    assert_states_close(got, want, rtol=0, atol=0)


def test_a_preference_run_resumes_bit_for_bit(tmp_path):
    """Crashed after its step-3 checkpoint and resumed: the reference log-probabilities read back from
    the run directory, the same losses and weights as the uninterrupted run, bit for bit."""
    data = tmp_path / "pairs.jsonl"
    write_pairs(data)

    def config(name: str, *more: str):
        return pair_config(tmp_path / name, "single", 1, "train.checkpoint_every=3", "train.checkpoint_async=false",
                           *more, data=data, steps=6)

    train_in_process(config("straight"))
    with pytest.raises(Crash):
        in_process(lambda ctx: crash_at(Trainer(config("resumed"), ctx), 4).fit())
    train_in_process(config("resumed", "run.resume=true"))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    got, want = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("resumed", "straight"))
    assert_states_close(got, want, rtol=0, atol=0)


BAD_PAIRS = [
    ({"prompt": "Say it:", "chosen": " YES!"}, "line 2: `rejected` is missing or empty"),
    ({"prompt": "Say it:", "chosen": " YES!", "rejected": ""}, "line 2: `rejected` is missing or empty"),
    ({"prompt": "Say it:", "chosen": " same", "rejected": " same"}, "line 2: `chosen` and `rejected` are the same"),
    ({"prompt": "x" * 40, "chosen": " YES!", "rejected": " no."}, "line 2: the pair needs 89 tokens (its prompt twice, "
     "then each answer), more than a window's model.seq_len + 1 = 65; data.truncate_prompt = true cuts its prompt"),
]


def with_bad_pair(directory: Path, line: dict) -> Path:
    good = {"prompt": "Say it:", "chosen": " YES!", "rejected": " yes."}
    (directory / "pairs.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(line) + "\n")
    return directory / "pairs.jsonl"


@pytest.mark.parametrize("line, words", BAD_PAIRS)
def test_bad_pairs_are_refused_naming_their_line(tmp_path, line, words):
    with pytest.raises(ConfigError) as error:
        make_datasets(pair_config(tmp_path / "run", "single", 1, data=with_bad_pair(tmp_path, line)))
    assert words in str(error.value) and "\n" not in str(error.value)


def test_shardwise_train_refuses_a_bad_pair_before_launch(tmp_path):
    """In one line, exit 2, no traceback, before any worker starts: nothing in the run directory."""
    line, words = BAD_PAIRS[-1]
    result = shardwise("train", str(CONFIGS / "gpt-tiny.toml"), "--set", f"data.path={with_bad_pair(tmp_path, line)}",
                       "--set", "data.format=preference", "--set", "train.objective=dpo",
                       "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and words in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_long_prompt_is_cut_from_its_left_when_asked(tmp_path):
    lines = [json.dumps({"prompt": f"{i} " + "x" * 40 + " Say it:", "chosen": " YES!", "rejected": " no."})
             for i in range(4)]
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    cfg = pair_config(tmp_path / "run", "single", 1, "data.truncate_prompt=true", data=tmp_path / "pairs.jsonl")
    train, _ = make_datasets(cfg)
    asked, chosen, rejected = train.lengths[0].tolist()
    assert 2 * asked + chosen + rejected <= cfg.model.seq_len + 1 and (chosen, rejected) == (5, 4)
    inputs, _ = train.batch(torch.tensor([0]))
    assert bytes(inputs[0, :asked].tolist()).decode().endswith("x Say it:")  # the prompt's end kept


@pytest.mark.parametrize("overrides, words", [
    (("train.objective=dpo",), "train.objective = 'dpo' with data.format = 'text': needs data.format = 'preference'"),
    (("data.format=preference", "data.path=pairs.jsonl"),
     "train.objective = 'sft' with data.format = 'preference': needs train.objective = 'dpo', 'ipo' or 'simpo'"),
    (("data.format=preference", "data.path=pairs.jsonl", "train.objective=dpo", "parallel.strategy=ddp",
      "launch.nproc=2", "parallel.cp=2"), "train.objective = 'dpo': not with context parallel (parallel.cp = 2)"),
    (("data.format=preference", "data.path=pairs.jsonl", "train.objective=ipo", "train.beta=0"), "train.beta = 0"),
    (("data.format=preference", "data.path=pairs.jsonl", "train.objective=dpo", "train.reference=copy", "lora.rank=4"),
     "train.reference = 'copy' with LoRA adapters: the reference is the base model the adapters leave untouched"),
])
def test_what_a_preference_objective_needs_is_checked_in_one_line(tmp_path, overrides, words):
    with pytest.raises(ConfigError) as error:
        gpt_tiny(tmp_path, "single", 1, *overrides, steps=1)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_conversation_pairs_count_what_the_chat_template_adds_for_each_answer(tmp_path):
    """A prompt of chat turns, answers as an assistant turn's string or a list of turns: each answer's
    counted tokens are what the template (examples/chat/tokenizer's) renders after the prompt with
    the reply prompt."""
    lines = [{"prompt": [{"role": "user", "content": word}], "chosen": f"{word.upper()}!",
              "rejected": [{"role": "assistant", "content": f"{word}."}]} for word in WORDS[:4]]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = pair_config(tmp_path / "run", "single", 1, f"data.tokenizer={REPO / 'examples/chat/tokenizer'}",
                      "data.val_fraction=0.25", data=tmp_path / "pairs.jsonl")
    assert counted_answers(cfg) == [answer for word in WORDS[:4] for answer in (f"{word.upper()}!\n\n", f"{word}.\n\n")]
    train, _ = make_datasets(cfg)
    inputs, _ = train.batch(torch.tensor([0]))
    assert bytes(inputs[0, : train.lengths[0][0]].tolist()).decode() == "USER.\nsword\n\nASSISTANT.\n"


def test_the_rewards_reach_the_trackers_and_the_report(trained, tmp_path):
    """Every step's four reward metrics as train/ scalars (TensorBoard, MLflow, W&B), the held-out
    ones as val/, and the report's reward-accuracy plot."""
    from shardwise.report import write_report
    from shardwise.trackers import scalars

    (step, *_), (summary,) = read_records(trained / "single"), read_records(trained / "single", "summary")
    assert {f"train/{key}": step[key] for key in REWARDS} == {k: v for k, v in scalars(step).items() if "reward" in k}
    assert scalars(summary)["val/reward_accuracy"] == summary["val_reward_accuracy"]
    page = write_report([trained / "single", trained / "ddp"], tmp_path / "report.html").read_text()
    assert 'id="reward-accuracy"' in page


def test_the_planner_refuses_a_frozen_copy_it_does_not_count_in_one_line(tmp_path):
    from shardwise.planner import PlanError, load_profile, make_plan

    data = tmp_path / "pairs.jsonl"
    write_pairs(data)
    assert make_plan(pair_config(tmp_path, "ddp", 2, data=data), 2, load_profile("cpu")).recommended is not None
    with pytest.raises(PlanError, match="train.reference = 'copy': the planner does not count the frozen copy"):
        make_plan(pair_config(tmp_path, "ddp", 2, "train.reference=copy", data=data), 2, load_profile("cpu"))
