"""Every causal-LM family of the pinned transformers (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) trains under
fsdp on 2 ranks as under single, every one with a tp plan under tensor on 2 ranks, and every one
with a pp plan under pipeline on 2 ranks (a stage each): each built
tiny from its own config class (2 blocks, width 64, a vocabulary of 512, 4 experts, Mamba-2 and
Gated DeltaNet mixers of 4 heads), from its config.json through model.name = 'hf' (or the family
of shardwise's that builds it), 3 steps of SGD on the same global batches (single's run once,
shared). A family the pre-launch check refuses is refused (ConfigError, naming why); one that
cannot be built small on the CPU, or trains only on inputs other than token ids, is excluded, with
its reason. None may differ silently, and the table of every family is printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

from shardwise import cli
from shardwise.config.load import hf_config_overrides, load_config
from shardwise.config.schema import Config, ConfigError
from shardwise.dist import DistContext

# The standard names every config class answers to (its attribute_map), and the sizes of the few
# families that name a size of their own; each is given only where the class has it.
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, max_position_embeddings=64, num_local_experts=4, num_experts=4,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, rotary_dim=8,
            decoder_layers=2, encoder_layers=2, d_model=64, decoder_ffn_dim=128, encoder_ffn_dim=128,
            decoder_attention_heads=4, encoder_attention_heads=4, n_layer=2, n_embd=64, n_head=4,
            num_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            # state-space and linear-attention mixers (Mamba-2's, Gated DeltaNet's): their heads times their
            # width twice the model's, a small state, and chunks of the sequence's length (the defaults'
            # 128 heads and chunks of 256 make a block of 8192 channels, padded 16-fold)
            mamba_n_heads=4, mamba_d_head=32, mamba_num_heads=4, mamba_head_dim=32, mamba_d_ssm=128,
            mamba_d_state=16, ssm_state_size=16, mamba_chunk_size=16, chunk_size=16, n_groups=1,
            linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            dim_head=16, dim_ff=128)
# Families whose tiny form needs a size of its own on top: a multi-head latent attention's heads as
# wide as its rotary part, a MoE by design whose class defaults to dense, per-layer kinds cut to the
# two blocks, a state-space mixer of its own names.
FAMILY_SIZES = {
    "deepseek_v2": dict(head_dim=8, num_experts_per_tok=2), "deepseek_v3": dict(head_dim=8),
    "longcat_flash": dict(head_dim=8), "youtu": dict(head_dim=8),
    "kimi_linear": dict(head_dim=8, linear_head_dim=16, linear_num_heads=4,
                        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"]),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    "nemotron": dict(num_key_value_heads=2), "mamba2": dict(num_heads=8, head_dim=16),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1]),
    "zaya": dict(num_experts_per_tok=1, layer_types=["hybrid", "hybrid"]),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "gemma4_text": dict(vocab_size_per_layer_input=512, hidden_size_per_layer_input=16),
    "gemma4": dict(text_config=dict(vocab_size_per_layer_input=512, hidden_size_per_layer_input=16)),
    "gemma3n_text": dict(num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"],
                         vocab_size_per_layer_input=512, hidden_size_per_layer_input=16),
    "roc_bert": dict(shape_vocab_size=512, pronunciation_vocab_size=512, shape_embed_dim=16,
                     pronunciation_embed_dim=16),
    "inkling2_text": dict(unpadded_vocab_size=512), "inkling2_loop_text": dict(unpadded_vocab_size=512),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "reformer": dict(is_decoder=True, attn_layers=["local", "local"], axial_pos_shape=[4, 4],
                     axial_pos_embds_dim=[32, 32]),
}
STEPS = 3
LARGEST = 5_000_000  # parameters: a family its tiny sizes leave larger is not small on the CPU


def tiny_values(config_class: type, default: object | None = None) -> dict:
    """`config_class`'s arguments for a tiny model: TINY's sizes it has (those it can set), and its
    sub-configs' (a vision tower's, a text model's) tiny too."""
    default = config_class() if default is None else default
    renamed = config_class.attribute_map

    def settable(name: str) -> bool:
        declared = getattr(type(default), name, None)
        try:
            present = hasattr(default, name)
        except Exception:  # noqa: BLE001 - a per-layer size: set per layer, not whole
            return False
        return present and not (isinstance(declared, property) and declared.fset is None)

    def held(name: str) -> object:
        try:
            return getattr(default, name)
        except Exception:  # noqa: BLE001 - a per-layer size a config will not give whole (Gemma 4's head_dim)
            return None

    values = {key: value for key, value in TINY.items() if settable(renamed.get(key, key))
              and (held(renamed.get(key, key)) is not None or key == "head_dim")}
    if held("kv_lora_rank") is not None:  # multi-head latent attention: one key/value per head
        values[renamed.get("num_key_value_heads", "num_key_value_heads")] = TINY["num_attention_heads"]
    for name in getattr(config_class, "sub_configs", None) or {}:
        sub = getattr(default, name, None)
        if hasattr(sub, "to_dict") and hasattr(sub, "attribute_map"):
            values[name] = {"model_type": getattr(sub, "model_type", ""), **tiny_values(type(sub), sub)}
    return values


class Excluded(Exception):
    """A family this test cannot run, and why (one of REASONS)."""


# (the first: at this test's tiny sizes, which some families would take in forms of their own)
REASONS = ("cannot be built small on the CPU", "needs inputs other than token ids")


def tiny_family(model_type: str, root: Path) -> Path:
    """The family's tiny config.json, written under `root`; Excluded where transformers cannot build
    or run it small on the CPU (a plain forward and backward on token ids, shardwise nowhere)."""
    import transformers

    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
        values = tiny_values(config_class)
        for key, value in FAMILY_SIZES.get(model_type, {}).items():  # a sub-config's sizes on top of its tiny ones
            values[key] = {**values[key], **value} if isinstance(value, dict) and isinstance(values.get(key), dict) \
                else value
        config = config_class(**values)
        with torch.device("meta"):
            size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    except Exception as error:
        raise Excluded(f"{REASONS[0]}: {type(error).__name__}: {str(error)[:120]}") from None
    if size > LARGEST:
        raise Excluded(f"{REASONS[0]}: {size:,} parameters at its tiny sizes")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    try:
        model(input_ids=torch.randint(0, 512, (2, 16)), use_cache=False).logits.float().sum().backward()
    except Exception as error:
        other_inputs = any(name in str(error) for name in ("pixel_values", "input_features", "decoder_input_ids",
                                                             "inputs_embeds", "language"))
        raise Excluded(f"{REASONS[other_inputs]}: {type(error).__name__}: {str(error)[:120]}") from None
    path = root / model_type / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(config.to_json_string())
    return path


def family_config(path: Path, out: Path, strategy: str, world: int) -> Config:
    """`shardwise train --hf-config PATH` as this test trains it, checked as the command checks it
    before launch (ConfigError where it refuses); a pipeline of one micro-batch per sample."""
    cfg = load_config(None, [*hf_config_overrides(str(path)), "model.seq_len=16", "data.name=synthetic-tokens",
                             f"parallel.strategy={strategy}", f"launch.nproc={world}", "train.global_batch=4",
                             "train.micro_batch=2", f"train.steps={STEPS}", "train.optimizer=sgd", "train.lr=0.1",
                             "train.weight_decay=0", "train.warmup_steps=0", "train.bad_step=off",
                             f"run.out={out}", "parallel.pipeline.micro_batches=2"])
    cli._check_before_launch(cfg)
    return cfg


def trained(cfg: Config, ctx: DistContext) -> tuple[list[float], dict[str, torch.Tensor], dict[str, int],
                                                     list[dict[str, int]]]:
    """Every step's loss, the final weights (whole, on rank 0), the bytes this rank holds of each
    parameter tensor parallel split (by the plain model's name), and each rank's parameters by name
    (their elements; a pipeline's copy of a tied weight a stage before it holds left out)."""
    from shardwise.trainer import Trainer

    trainer = Trainer(cfg, ctx)
    losses = [trainer.run_step(step) for step in range(STEPS)]
    strategy = trainer.strategy
    shards, copies = getattr(strategy, "tensor_shards", {}), getattr(strategy, "duplicates", set())
    split = {name: p.nbytes for name, p in strategy.module.named_parameters() if id(p) in shards}
    held = ctx.all_gather_object({name: p.numel() for name, p in strategy.view.named_parameters()
                                  if id(p) not in copies})
    return losses, strategy.view.full_state_dict(), split, held


def runs(ctx: DistContext, configs: dict[str, Config]) -> dict[str, tuple]:
    """Each family's run on these ranks: what `trained` returns, or the error that stopped it."""
    out = {}
    for family, cfg in configs.items():
        try:
            out[family] = trained(cfg, ctx)
        except Exception as error:  # noqa: BLE001 - reported as the family's failure, the ranks go on
            out[family] = f"{type(error).__name__}: {str(error)[:200]}"
    return out if ctx.is_main else {}


@pytest.fixture(scope="module")
def tiny_configs(tmp_path_factory) -> dict[str, Path | Excluded]:
    """Every causal-LM family's tiny config.json, or why it is excluded."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = tmp_path_factory.mktemp("configs")
    found: dict[str, Path | Excluded] = {}
    for family in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            found[family] = tiny_family(family, root)
        except Excluded as why:
            found[family] = why
    return found


@pytest.fixture(scope="module")
def singles(tiny_configs, tmp_path_factory) -> dict[str, tuple | tuple[str, str]]:
    """family -> its run under single (losses, weights, parameters), or why there is none: ('excluded', REASONS),
    ('refused', before launch) or ('fails', after)."""
    root = tmp_path_factory.mktemp("single")
    found = {}
    for family, path in tiny_configs.items():
        if isinstance(path, Excluded):
            found[family] = ("excluded", str(path))
            continue
        try:
            cfg = family_config(path, root / family, "single", 1)
        except ConfigError as why:
            found[family] = ("refused", str(why))
            continue
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as every rank computes: the thread count changes the order of sums
        try:
            losses, weights, _, held = trained(cfg, DistContext(0, 1, 0, torch.device("cpu"), "gloo"))
            found[family] = losses, weights, held[0]
        except Exception as error:  # noqa: BLE001 - after launch: a failure of shardwise's, reported
            found[family] = ("fails", f"under single: {type(error).__name__}: {str(error)[:200]}")
        finally:
            torch.set_num_threads(threads)
    return found


def against_single(strategy: str, world: int, families: list[str], tiny_configs: dict, singles: dict,
                   root: Path) -> tuple[dict[str, tuple[str, str]], dict[str, tuple[dict[str, int], list]]]:
    """family -> (result, why) under `strategy` on `world` ranks: 'equal', 'refused' (before launch),
    'excluded' (REASONS), 'fails' (raised after launch, where it should have been refused before) or
    'differs' (trained, not as single); and each equal family's split bytes on rank 0 by name and
    every rank's parameters (`trained`)."""
    result, configs, split = {}, {}, {}
    for family in families:
        if isinstance(singles[family][0], str):
            result[family] = singles[family]
            continue
        try:
            configs[family] = family_config(tiny_configs[family], root / family, strategy, world)
        except ConfigError as why:
            result[family] = ("refused", str(why))
    for family, got in run_ranks(runs, world, configs, timeout=900)[0].items():
        if isinstance(got, str):
            result[family] = ("fails", f"under {strategy}: {got}")
            continue
        (losses, weights, *split[family]), (want_losses, want_weights, _) = got, singles[family]
        try:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
            assert weights.keys() == want_weights.keys()
            for key in want_weights:
                torch.testing.assert_close(weights[key], want_weights[key], rtol=1e-5, atol=1e-6)
            result[family] = ("equal", f"losses {losses[0]:.4f} .. {losses[-1]:.4f}")
        except AssertionError as error:
            result[family] = ("differs", str(error).splitlines()[0][:200])
    return result, split


def print_table(table: dict[str, tuple[str, str]], what: str) -> dict[str, int]:
    print(f"\n{len(table)} causal-LM families of transformers {what} against single:")
    for family, (outcome, why) in sorted(table.items(), key=lambda item: (item[1][0], item[0])):
        print(f"  {family:28} {outcome:9} {why}")
    counts = {outcome: sum(o == outcome for o, _ in table.values())
              for outcome in ("equal", "refused", "excluded", "fails", "differs")}
    print(json.dumps(counts))
    return counts


def assert_none_silent(result: dict[str, tuple[str, str]]) -> None:
    """No family differs silently or fails after launch; each excluded one says why, and each
    refused one is refused in one line naming it."""
    assert not [f for f, (o, _) in result.items() if o == "differs"], "families that differ silently"
    assert not [f for f, (o, _) in result.items() if o == "fails"], "families the pre-launch check let through"
    assert all(why.startswith(REASONS) for o, why in result.values() if o == "excluded")
    for family, (outcome, why) in result.items():
        if outcome == "refused":
            assert "\n" not in why and (family in why or "model_type" in why), (family, why)


def every_planned(plan: str, strategy: str, tiny_configs: dict, singles: dict, tmp_path_factory: pytest.TempPathFactory,
                  capsys: pytest.CaptureFixture) -> tuple[list[str], dict, dict, dict[str, int]]:
    """Every family whose config class declares `plan`, under `strategy` on 2 ranks against single:
    the families, `against_single`'s two results (checked: `assert_none_silent`) and the counts."""
    import transformers

    planned = [f for f in tiny_configs if getattr(transformers.CONFIG_MAPPING[f], plan, None)]
    result, held = against_single(strategy, 2, planned, tiny_configs, singles, tmp_path_factory.mktemp(strategy))
    with capsys.disabled():
        counts = print_table(result, f"with a {plan}, under {strategy} on 2 ranks")
    assert_none_silent(result)
    return planned, result, held, counts


@pytest.fixture(scope="module")
def table(tiny_configs, singles, tmp_path_factory) -> dict[str, tuple[str, str]]:
    return against_single("fsdp", 2, list(tiny_configs), tiny_configs, singles, tmp_path_factory.mktemp("fsdp"))[0]


@pytest.mark.slow
def test_every_causal_lm_family_trains_under_fsdp_as_under_single_or_is_refused_or_excluded(table, capsys):
    with capsys.disabled():
        counts = print_table(table, "under fsdp on 2 ranks")
    assert_none_silent(table)
    assert counts["equal"] >= 174 and counts["refused"] <= 6


@pytest.mark.slow
def test_every_family_with_a_tp_plan_splits_under_tensor_as_its_plan_says_or_is_refused(tiny_configs, singles,
                                                                                        tmp_path_factory, capsys):
    """Issue 69, step 2: each family whose transformers config declares a base_model_tp_plan, under
    `tensor` on 2 ranks split as that plan says, trains as under single; or the pre-launch check
    refuses it, naming the family, the layer and the style. Each tp rank holds half of every
    parameter the plan splits (bytes counted)."""
    planned, result, split, counts = every_planned("base_model_tp_plan", "tensor", tiny_configs, singles,
                                                   tmp_path_factory, capsys)
    assert len(planned) == 116
    for family, (outcome, _) in result.items():
        if outcome == "equal":  # the split happened: half of each split tensor on this rank
            weights = singles[family][1]
            held = split[family][0]
            assert held and all(2 * n == weights[name].nbytes for name, n in held.items()), family
    assert counts["equal"] >= 103


@pytest.mark.slow
def test_every_family_with_a_pp_plan_cuts_into_stages_under_pipeline_or_is_refused(tiny_configs, singles,
                                                                                   tmp_path_factory, capsys):
    """Issue 69, step 3: each family whose transformers config declares a base_model_pp_plan, cut
    into two stages (one block each, the embeddings on the first, the final norm and the head on
    the last) under `pipeline` on 2 ranks, 2 micro-batches of 1F1B, trains as under single; or the
    pre-launch check refuses it in one line. Each rank holds its stage's parameters only: the two
    ranks' are the single model's, split between them (a tied head's copy aside)."""
    planned, result, held, counts = every_planned("base_model_pp_plan", "pipeline", tiny_configs, singles,
                                                  tmp_path_factory, capsys)
    assert len(planned) == 92
    for family, (outcome, _) in result.items():
        if outcome == "equal":  # each rank holds its stage's parameters, the two ranks the whole model's
            stages, whole = held[family][1], singles[family][2]
            assert all(stage and stage.keys() < whole.keys() for stage in stages), family
            assert not stages[0].keys() & stages[1].keys(), family
            assert {**stages[0], **stages[1]} == whole, family
    assert counts["equal"] >= 81


@pytest.mark.slow
def test_the_planner_plans_every_family_or_refuses_it_in_one_line(tiny_configs, capsys):
    """`shardwise plan --hf-config` of each family (issue 69, step 5): a plan, or a PlanError (or
    ConfigError) naming why, never a traceback. Refused: the families whose forward fake tensors cannot
    follow, or that run a block more than once a pass."""
    from shardwise.planner import PlanError, load_profile, make_plan

    cpu, planned, refused = load_profile("cpu"), [], {}
    for family, path in tiny_configs.items():
        if isinstance(path, Excluded):
            continue
        try:
            cfg = load_config(None, [*hf_config_overrides(str(path)), "model.seq_len=16", "parallel.strategy=ddp",
                                     "launch.nproc=2"])
            plan = make_plan(cfg, 2, cpu, precisions=("fp32",), policies=("none",))
        except (PlanError, ConfigError) as why:
            refused[family] = str(why)
            continue
        assert plan.recommended is not None and plan.params_total > 0, family
        planned.append(family)
    with capsys.disabled():
        print(f"\nthe planner: {len(planned)} families planned, {len(refused)} refused:")
        for family, why in refused.items():
            print(f"  {family:28} {why[-150:]}")
    assert len(planned) >= 162 and len(refused) <= 18
