"""Parallel plans: how the strategies that split a model (`tensor`, `pipeline`, `model-parallel`, and
their dp x pp x tp mesh) cut each model family, and where context parallel feeds it positions,
declared by module names. The strategies read
the plan and never a model's names; the model itself stays as its authors wrote it.

A plan declares:
- `blocks`: the class names of the repeated block. Its instances are the entries of one
  `nn.ModuleList`, in order; a pipeline cuts between them (a stage holds consecutive blocks).
- `regions`: the tensor-parallel layout of a block. A region is a module of the block (attention,
  the MLP) whose input enters column-parallel layers (their output features split over the tp
  ranks) and whose output leaves one row-parallel layer (its input features split, the partial
  outputs summed). An attention region names where its module keeps its head count (and, for
  grouped-query attention, its key/value heads), so that tp can be checked to divide them; the
  module must count the heads it computes from its layers' outputs (all three families here do)
  or name the attributes that hold per-rank sizes in `per_rank`. Everything of a block outside
  the regions' layers (norms, the row-parallel layers' biases) is replicated.
- `first_stage`, `last_stage`: the modules outside the blocks that only the first pipeline stage
  holds (the embeddings) and only the last (the final norm and the head, last of all). Anything
  else outside the blocks (a rotary embedding, dropout) runs on every stage and must hold no
  parameters. Under `tensor` these are replicated.
- `weights_in_out`: the layers store their weight [in, out] (transformers' `Conv1D`, GPT-2's),
  transposed from `nn.Linear`'s [out, in].
- `positions`: the module outside the blocks that takes the tokens' positions (a learned position
  embedding, a rotary embedding) and which of its arguments they are. Context parallel
  (`parallel.cp`) gives each rank a part of the sequence and feeds this argument the global
  positions of its tokens in place of the 0 .. local length the model counts.

Names are matched on their last components: `embed_tokens` finds `model.embed_tokens` in a
LlamaForCausalLM and `lm.model.embed_tokens` in shardwise's wrapper of one. A region's names are
relative to the block. `docs/model-families.md` walks through writing a plan; a model of your own
family carries its plan as its `parallel_plan` attribute.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Column:
    """A column-parallel layer; `parts` > 1 for one that computes several projections at once
    (q, k and v: 3), each split on its own so that a rank holds the same heads of each."""

    name: str
    parts: int = 1


@dataclass(frozen=True)
class Region:
    module: str  # the block's module whose input enters `column` and whose output leaves `row`
    column: tuple[str | Column, ...]
    row: str
    heads: str | None = None  # attention: the attribute (path) holding the module's head count
    kv_heads: str | None = None  # grouped-query attention: its key/value heads (unset: `heads`)
    per_rank: tuple[str, ...] = ()  # attributes the module's forward reads as sizes of what it computes: divided by tp

    @property
    def columns(self) -> tuple[Column, ...]:
        return tuple(c if isinstance(c, Column) else Column(c) for c in self.column)


@dataclass(frozen=True)
class Positions:
    module: str  # outside the blocks
    argument: int | str  # a positional argument's index, or a keyword argument's name


@dataclass(frozen=True)
class StackedExperts:
    """A module of experts that stacks each projection's weights in one 3-D parameter [experts, ., .]
    (transformers' MoE experts): each split along the dimension of the experts' hidden features
    (`dim` 1 or 2, as the family lays it out; `parts` halves such as gate and up, each split on its
    own), so each tp rank computes every expert on its slice of them."""

    module: str  # relative to the block
    params: tuple[tuple[str, int, int], ...]  # (name, dim, parts)


@dataclass(frozen=True)
class ParallelPlan:
    family: str
    models: tuple[str, ...]  # the config's `model.name`s it splits
    blocks: tuple[str, ...]
    regions: tuple[Region, ...]
    first_stage: tuple[str, ...]
    last_stage: tuple[str, ...]
    weights_in_out: bool = False
    positions: Positions | None = None  # unset: context parallel cannot split this family's sequences
    # transformers' plans name patterns: a block splits the regions it has (a MoE layer has no dense
    # MLP's), where a plan written here expects every region in every block
    where_present: bool = False
    # the transformers model_types a plan written here splits, in place of their own plans
    model_types: tuple[str, ...] = ()
    # layers outside the regions (paths within a block) split on their own, every rank's input and
    # output whole: `gathered` split along their output features and gathered after, `split_input`
    # along their input features, each rank taking its slice of the input, the partial outputs summed
    gathered: tuple[str, ...] = ()
    split_input: tuple[str, ...] = ()
    # modules of stacked experts split along their hidden features (`StackedExperts`)
    experts: tuple[StackedExperts, ...] = ()
    # embeddings outside the blocks (paths in the model) split along their vocabulary: each rank
    # looks up the ids in its rows, the others' rows read as zeros, the results summed
    vocabulary: tuple[str, ...] = ()

    def regions_in(self, block: nn.Module) -> tuple[Region, ...]:
        """The regions `block` splits: all of them, or (`where_present`) those it has, each with the
        columns it has (a latent attention's q_proj or its q_a_proj and q_b_proj, as configured)."""
        if not self.where_present:
            return self.regions
        return tuple(dataclasses.replace(r, column=tuple(c for c in r.columns
                                                         if has_module(block, f"{r.module}.{c.name}")))
                     for r in self.regions if _has_region(block, r))


GPT = ParallelPlan(
    family="gpt",
    models=("gpt",),
    blocks=("Block",),
    regions=(
        Region("attn", column=(Column("qkv", parts=3),), row="proj", heads="n_head"),
        Region("mlp", column=("up",), row="down"),
    ),
    first_stage=("tok_emb", "pos_emb"),
    last_stage=("ln_f", "head"),
    positions=Positions("pos_emb", 0),
)

# GPT-2's attention splits its fused qkv by `split_size`, which must then be this rank's width.
GPT2 = ParallelPlan(
    family="gpt2",
    models=("hf-gpt2",),
    blocks=("GPT2Block",),
    regions=(
        Region("attn", column=(Column("c_attn", parts=3),), row="c_proj", heads="num_heads",
               per_rank=("num_heads", "embed_dim", "split_size")),
        Region("mlp", column=("c_fc",), row="c_proj"),
    ),
    first_stage=("wte", "wpe"),
    last_stage=("ln_f", "lm_head"),
    weights_in_out=True,
    positions=Positions("wpe", 0),
    model_types=("gpt2",),
)

# gpt-moe: the GPT's blocks with a Mixture-of-Experts layer for the MLP. Tensor parallel splits their
# attention; the MoE layer stays whole on every tp rank (its experts are split by expert parallel).
GPT_MOE = ParallelPlan(
    family="gpt-moe",
    models=("gpt-moe",),
    blocks=("Block",),
    regions=(GPT.regions[0],),
    first_stage=GPT.first_stage,
    last_stage=GPT.last_stage,
    positions=GPT.positions,
)

# transformers' Mixtral and Qwen3-MoE: Llama's attention (Qwen3's per-head q and k norms whole on
# every rank, as each rank's heads are whole), split over tp; the MoE layer whole on every tp rank, as
# gpt-moe's, its experts split by expert parallel (their own plans split the experts over tp).
MIXTRAL = ParallelPlan(
    family="mixtral",
    models=("hf-mixtral", "hf-qwen3-moe"),
    blocks=("MixtralDecoderLayer", "Qwen3MoeDecoderLayer"),
    regions=(Region("self_attn", column=("q_proj", "k_proj", "v_proj"), row="o_proj",
                    heads="config.num_attention_heads", kv_heads="config.num_key_value_heads"),),
    first_stage=("embed_tokens",),
    last_stage=("norm", "lm_head"),
    positions=Positions("rotary_emb", "position_ids"),  # transformers calls it rotary_emb(x, position_ids=...)
    model_types=("mixtral", "qwen3_moe"),
)

PLANS: tuple[ParallelPlan, ...] = (GPT, GPT2, GPT_MOE, MIXTRAL)  # shipped, the first found for a model first

NEEDS = ("the class of its repeated block; per block, its tensor-parallel regions (a module whose input enters "
         "column-parallel layers and whose output leaves a row-parallel one, and for attention where its head "
         "counts live); the modules outside the blocks that only the first pipeline stage holds (embeddings) and "
         "only the last (final norm, head)")


class PlanError(ValueError):
    """A model has no plan, or does not fit its plan; the message says what is missing."""


# transformers' own plans, read as ours: a family's `base_model_tp_plan` (a pattern naming layers
# under its layers' list -> a style) and `base_model_pp_plan` (the base model's modules in order:
# embeddings, the layers' list, the final norm).
#
# A block's layers are grouped by the module that holds them (its attention, its MLP). A group of
# column-parallel layers (`colwise`; `packed_colwise`: several projections in one layer, gate and up,
# each split on its own) and one row-parallel layer (`rowwise`) is a region, as a plan written here
# declares one. A layer whose output is gathered (`colwise_gather_output`) or whose input every rank
# holds whole and slices (`rowwise_split_input`) is split on its own, in a module of no region's
# (OLMo 2's and Phi-3's attention, computed whole on every rank between them). Beside them:
# - `replicated_with_grad_allreduce` and `mla_kv_a_proj` inside a region: whole on every tp rank,
#   their gradients summed over them, as every whole parameter of a region's is;
# - `local_params` and `all_reduce` on a region's module: nothing more than a region does;
# - `moe_tp_experts`: a module of stacked experts, its 3-D parameters split along the experts'
#   hidden features by the dimension their styles name (`StackedExperts`);
# - `embedding_rowwise`, outside the blocks: the embedding split along its vocabulary; `replicate`:
#   kept whole.
# Any other style, or a group that is not one region, is refused by `read_tp_plan`, before any worker
# starts where the config names the family: a PlanError naming the family, the layer and its style.

COLUMN_STYLES = {"colwise": 1, "packed_colwise": 2}  # -> the projections a layer computes at once
ROW_STYLE = "rowwise"
GATHERED, SPLIT_INPUT = "colwise_gather_output", "rowwise_split_input"
# a layer or parameter a region holds whole, its gradient summed over tp as every whole parameter of a
# region's is: per-head norms, and multi-head latent attention's kv_a_proj_with_mqa, whose rotary part
# reaches every rank's heads
WHOLE_IN_REGION = ("replicated_with_grad_allreduce", "mla_kv_a_proj")
# styles on a region's module itself: what transformers' DTensors need and a region does already
ON_REGION = ("local_params", "all_reduce")
EXPERTS = "moe_tp_experts"
# a stacked expert parameter's style -> the dimension it splits and its parts: transformers names the
# styles of 3-D weights by dimension (colwise: 1, rowwise: 2), whichever side the family keeps its
# hidden features on
STACKED_STYLES = {"colwise": (1, 1), "packed_colwise": (1, 2), "rowwise": (2, 1), "packed_rowwise": (2, 2)}
VOCABULARY = "embedding_rowwise"  # an embedding outside the blocks, split along its vocabulary (rows)
WHOLE_OUTSIDE = ("replicate",)


@dataclass(frozen=True)
class Group:
    """The layers of one module of a block, and their styles: a region once it checks."""

    module: str  # relative to the block
    columns: tuple[Column, ...]
    row: str | None


@dataclass(frozen=True)
class TpLayout:
    """What a transformers tp plan splits in a block: its regions, and the layers split on their own."""

    groups: tuple[Group, ...]
    gathered: tuple[str, ...]
    split_input: tuple[str, ...]
    experts: tuple[StackedExperts, ...]
    vocabulary: tuple[str, ...]  # embeddings outside the blocks, relative to the base model


def read_tp_plan(family: str, tp_plan: dict[str, str]) -> TpLayout:
    """`tp_plan`'s regions, each a module of the block with its column and row layers; its layers split
    on their own, its stacked experts and its embeddings split along their vocabulary; PlanError
    naming the family, the layer and its style for what shardwise does not split."""
    columns: dict[str, list[Column]] = {}
    rows: dict[str, list[str]] = {}
    alone: dict[str, list[str]] = {GATHERED: [], SPLIT_INPUT: []}
    on_region: dict[str, str] = {}
    vocabulary: list[str] = []
    expert_keys = [key for key, style in tp_plan.items() if style == EXPERTS]
    stacked: dict[str, list[tuple[str, int, int]]] = {}  # an experts module -> its parameters' splits
    for key, style in tp_plan.items():
        listed, star, inner = key.partition(".*.")
        if not star:
            if style == VOCABULARY:
                vocabulary.append(key)
            elif style not in WHOLE_OUTSIDE:
                raise PlanError(f"{family}: tensor parallel style {style!r} of {key!r} (outside the blocks) is not one "
                                f"shardwise applies; it splits {VOCABULARY} and keeps {', '.join(WHOLE_OUTSIDE)} whole")
            continue
        if "*" in inner:
            raise PlanError(f"{family}: the tensor parallel plan's {key!r} names modules under a second wildcard (a "
                            "list within a block); shardwise splits modules at fixed paths within a block")
        module, _, layer = inner.rpartition(".")
        if style == EXPERTS:
            continue
        if any(key.startswith(f"{expert}.") for expert in expert_keys):  # a stacked parameter of its experts
            if style not in STACKED_STYLES:
                raise PlanError(f"{family}: tensor parallel style {style!r} of {key!r}, in a module of experts, is not "
                                f"one shardwise splits (it splits {', '.join(STACKED_STYLES)} there)")
            stacked.setdefault(module, []).append((layer, *STACKED_STYLES[style]))
            continue
        if style in COLUMN_STYLES:
            columns.setdefault(module, []).append(Column(layer, COLUMN_STYLES[style]))
        elif style == ROW_STYLE:
            rows.setdefault(module, []).append(layer)
        elif style in alone:
            alone[style].append(inner)
        elif style in ON_REGION:
            on_region[inner] = style
        elif style not in WHOLE_IN_REGION:
            raise PlanError(f"{family}: tensor parallel style {style!r} of {key!r} is not one shardwise splits "
                            f"yet (it splits {', '.join(COLUMN_STYLES)}, {ROW_STYLE}, {GATHERED}, {SPLIT_INPUT}, "
                            f"{', '.join(WHOLE_IN_REGION)} and {EXPERTS})")
    for module, style in on_region.items():
        if module not in rows:
            raise PlanError(f"{family}: tensor parallel style {style!r} of {module!r}, which is no region (no "
                            "row-parallel layer in it), is not one shardwise applies")
    groups = []
    for module in sorted(columns.keys() | rows.keys()):
        row = rows.get(module, [])
        if len(row) != 1 or not columns.get(module):
            raise PlanError(f"{family}: the tensor parallel plan's layers in {module or 'the block'!r} are "
                            f"{len(columns.get(module, []))} column-parallel and {len(row)} row-parallel; shardwise "
                            "splits a module whose input enters column-parallel layers and whose output leaves one "
                            "row-parallel layer")
        if not module:
            raise PlanError(f"{family}: the tensor parallel plan splits layers of the block itself; shardwise splits "
                            "modules within it (its attention, its MLP)")
        inside = [name for name in alone[GATHERED] + alone[SPLIT_INPUT] if name.startswith(f"{module}.")]
        if inside:  # its input is the region's, whose gradient the region already sums over tp
            raise PlanError(f"{family}: {inside[0]!r} is split on its own inside the region {module!r}; shardwise "
                            "splits a layer on its own only outside the regions")
        groups.append(Group(module, tuple(columns[module]), row[0]))
    experts = tuple(StackedExperts(module, tuple(params)) for module, params in sorted(stacked.items()))
    if not groups and not alone[GATHERED] + alone[SPLIT_INPUT] and not experts and not vocabulary:
        raise PlanError(f"{family}: its tensor parallel plan splits nothing inside its layers "
                        f"({', '.join(f'{key}: {style}' for key, style in tp_plan.items()) or 'it declares none'})")
    return TpLayout(tuple(groups), tuple(alone[GATHERED]), tuple(alone[SPLIT_INPUT]), experts, tuple(vocabulary))


def largest_layer_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The nn.ModuleList of layers of one class that holds the most parameters, and its name: a
    model's layers where nothing names them. None if it has none."""
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) and len({type(entry) for entry in m}) == 1]
    return max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()), default=None)


def text_config(config: object) -> object:
    """A transformers config's text model's (a multimodal family's language model's), or itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def transformers_model(model: nn.Module) -> nn.Module | None:
    """The transformers model in `model` (shardwise's CausalLM holds one), or None."""
    return next((m for m in model.modules() if hasattr(m, "base_model_prefix") and hasattr(m, "config")), None)


def plan_from_transformers(model: nn.Module, split: bool = True) -> ParallelPlan:
    """The plan `model`'s transformers family declares; PlanError where it declares none or declares
    what shardwise does not split. Not `split` (no tp ranks: a pipeline's stages alone), its tp plan
    is not read, only where its blocks and the modules outside them lie."""
    lm = transformers_model(model)
    if lm is None:
        raise PlanError(f"{type(model).__name__} is no transformers model")
    config = text_config(lm.config)
    family = config.model_type
    layout = read_tp_plan(family, getattr(config, "base_model_tp_plan", None) or {}) if split else \
        TpLayout((), (), (), (), ())
    # the layers' list the patterns name (cut into stages alone: the pp plan's); for a plan that splits
    # only an embedding, the pp plan's, else the largest list of layers
    named = {key.partition(".*.")[0] for key in config.base_model_tp_plan if ".*." in key}
    staged = set(getattr(config, "base_model_pp_plan", None) or ())
    listed = (named or staged) if split else (staged or named)
    lists = [(name, m) for name, m in lm.named_modules() if isinstance(m, nn.ModuleList) and len(m)
             and name.rpartition(".")[2] in listed]
    if not listed:
        lists = [found] if (found := largest_layer_list(lm)) else []
    if len(lists) != 1:
        found = ", ".join(name for name, _ in lists) or "none"
        raise PlanError(f"{family}: the layers its {'tensor' if split else 'pipeline'} parallel plan names "
                        f"({', '.join(sorted(listed))}) are {len(lists)} lists of the model ({found}); shardwise "
                        "cuts and splits the blocks of one list of layers")
    path, layers = lists[0]
    blocks = tuple(dict.fromkeys(type(layer).__name__ for layer in layers))  # a hybrid's kinds of layer
    block = blocks[0]
    regions = []
    for group in layout.groups:
        region = Region(group.module, group.columns, group.row)
        modules = [b.get_submodule(group.module) for b in layers if _has_region(b, region)]
        if not modules:  # a pattern for layers this model has none of (its dense MLPs, all its layers MoE)
            continue
        attention = all(hasattr(getattr(m, "config", None), "num_attention_heads") and "attention" in
                        type(m).__name__.lower() for m in modules)
        kv = attention and all(hasattr(m.config, "num_key_value_heads") for m in modules)
        regions.append(Region(group.module, group.columns, group.row, heads="config.num_attention_heads"
                              if attention else None, kv_heads="config.num_key_value_heads" if kv else None))
    gathered, split_input = ([name for name in names if any(has_module(b, name) for b in layers)]
                              for names in (layout.gathered, layout.split_input))
    experts = []
    for stacked in layout.experts:
        held = [b.get_submodule(stacked.module) for b in layers if _has_experts(b, stacked)]
        if held:
            _check_stacked(family, held[0], stacked)
            experts.append(stacked)
    base_path = path.rpartition(".")[0]
    prefix = f"{base_path}." if base_path else ""
    vocabulary = [prefix + name for name in layout.vocabulary
                  if has_module(lm, prefix + name) and type(lm.get_submodule(prefix + name)) is nn.Embedding]
    if split and not regions and not gathered + split_input and not experts and not vocabulary:
        raise PlanError(f"{family}: none of its {block}s has the modules its tensor parallel plan splits")
    first, last = _stages(lm, lm.get_submodule(base_path), base_path, path.rpartition(".")[2], config)
    # the rotary embedding transformers' base models call with the tokens' positions (`position_ids=`)
    rotary = f"{prefix}rotary_emb"
    positions = Positions(rotary, "position_ids") if has_module(lm, rotary) else None
    in_out = any(type(b.get_submodule(f"{r.module}.{r.row}")).__name__ == "Conv1D" for b in layers for r in regions
                 if _has_region(b, r))
    return ParallelPlan(family=family, models=("hf",), blocks=blocks, regions=tuple(regions), first_stage=first,
                        last_stage=last, weights_in_out=in_out, positions=positions, where_present=True,
                        gathered=tuple(gathered), split_input=tuple(split_input), experts=tuple(experts),
                        vocabulary=tuple(vocabulary))


def _stages(lm: nn.Module, base: nn.Module, base_path: str, layers: str,
            config: object) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The modules outside the blocks that the first pipeline stage holds (the embeddings) and the
    last (the final norm, then the head): in the order of the family's pp plan where it declares one,
    then the other modules of the base model outside its layers that hold parameters (embeddings
    first, the rest last); the head last of all."""
    prefix = f"{base_path}." if base_path else ""
    holders = [name for name, m in base.named_children() if name != layers and any(True for _ in m.parameters())]
    named = [name for name in getattr(config, "base_model_pp_plan", None) or {} if name in (*holders, layers)]
    before = named[:named.index(layers)] if layers in named else []
    first = [*before, *(n for n in holders if n not in named and isinstance(getattr(base, n), nn.Embedding))]
    last = [n for n in (*named, *holders) if n not in first and n != layers]
    output = lm.get_output_embeddings()
    head = [name for name, m in lm.named_modules() if m is output and m is not None and name]
    return tuple(prefix + n for n in dict.fromkeys(first)), tuple(prefix + n for n in dict.fromkeys(last)) + tuple(head)


def plan_for_name(model_name: str) -> ParallelPlan | None:
    """The plan for the config's `model.name`, or None."""
    return next((plan for plan in PLANS if model_name in plan.models), None)


def plan_for(model: nn.Module, split: bool = True) -> ParallelPlan:
    """The model's own plan (its `parallel_plan` attribute, for your own family); for a transformers
    model the plan written here for its model_type, else the one its family declares
    (`plan_from_transformers`); else the shipped plan whose block class the model holds and whose
    regions its first block has (the GPT and gpt-moe share a block class); PlanError naming what a
    plan needs if none. Not `split`: a transformers family's plan of its stages only (see
    `plan_from_transformers`)."""
    own = getattr(model, "parallel_plan", None)
    if isinstance(own, ParallelPlan):
        return own
    lm = transformers_model(model)
    if lm is not None:
        model_type = text_config(lm.config).model_type
        hand = next((plan for plan in PLANS if model_type in plan.model_types), None)
        return hand or plan_from_transformers(model, split)
    for plan in PLANS:
        block = next((m for m in model.modules() if type(m).__name__ in plan.blocks), None)
        if block is not None and all(_has_region(block, region) for region in plan.regions):
            return plan
    known = "; ".join(f"{plan.family} ({', '.join(plan.blocks)})" for plan in PLANS)
    raise PlanError(f"no parallel plan for {type(model).__name__}: none of its modules is a block of a known plan "
                    f"({known}). A plan names {NEEDS}; write one (docs/model-families.md) and give it to the model "
                    "as its `parallel_plan` attribute")


def _has_experts(block: nn.Module, stacked: StackedExperts) -> bool:
    """Whether `block` has the module of stacked experts, with its parameters."""
    module = block.get_submodule(stacked.module) if has_module(block, stacked.module) else None
    return module is not None and all(isinstance(getattr(module, name, None), nn.Parameter)
                                      for name, _, _ in stacked.params)


def _check_stacked(family: str, module: nn.Module, stacked: StackedExperts) -> None:
    """The module holds the plan's stacked parameters (and biases along their hidden features)
    alone, every one 3-D with the same hidden features along the dimension it splits (so gate, up
    and down are cut alike); PlanError naming what is not: another parameter, a bias added by every
    rank before the sum (down's), another layout."""
    hidden = set()
    for name, dim, parts in stacked.params:
        weight = getattr(module, name)
        hidden.add(weight.shape[dim] // parts if weight.dim() == 3 else None)
        bias = getattr(module, f"{name}_bias", None)
        if bias is not None and bias.shape[-1] != weight.shape[dim]:
            raise PlanError(f"{family}: the experts of {stacked.module!r} add {name}_bias after the sum over their "
                            "hidden features; shardwise splits stacked experts whose biases are along them")
    expected = {name for name, _, _ in stacked.params} | {f"{name}_bias" for name, _, _ in stacked.params}
    extra = [key for key, _ in module.named_parameters(recurse=False) if key not in expected]
    if extra or any(True for child in module.children() for _ in child.parameters()):
        what = extra[0] if extra else "modules with parameters of their own"
        raise PlanError(f"{family}: the experts of {stacked.module!r} hold {what} beside the parameters the tensor "
                        "parallel plan splits; shardwise splits stacked experts that hold only those")
    if len(hidden) != 1 or None in hidden:
        shapes = ", ".join(f"{name} {tuple(getattr(module, name).shape)} along {d}" for name, d, _ in stacked.params)
        raise PlanError(f"{family}: the experts of {stacked.module!r} do not split along one size of hidden features "
                        f"as the tensor parallel plan says ({shapes})")


def has_module(block: nn.Module, name: str) -> bool:
    """Whether `block` has a module (or a parameter) at path `name`."""
    owner, _, leaf = name.rpartition(".")
    try:
        module = block.get_submodule(owner)
        return isinstance(getattr(module, leaf, None), nn.Parameter) or isinstance(module.get_submodule(leaf),
                                                                                   nn.Module)
    except AttributeError:
        return False


def _has_region(block: nn.Module, region: Region) -> bool:
    """Whether `block` has `region`'s module, its row layer and a column of it (all of them unless
    its plan's regions are `where_present`'s)."""
    return has_module(block, f"{region.module}.{region.row}") and \
        any(has_module(block, f"{region.module}.{c.name}") for c in region.columns)


def matches(name: str, pattern: str) -> bool:
    """Whether dotted `name` ends with the components of `pattern` (`*` within a component)."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) >= len(wanted) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts[-len(wanted):], wanted,
                                                                                           strict=True))


@dataclass
class Located:
    """A plan found in one model: its blocks in order, the ModuleList holding them, and the modules
    the first and the last pipeline stage own outside them, by name."""

    plan: ParallelPlan
    model: nn.Module
    blocks: list[nn.Module]
    layers: str  # the ModuleList's name in the model
    first: dict[str, nn.Module]
    last: dict[str, nn.Module]

    def replace(self, name: str, module: nn.Module) -> None:
        """Put `module` in the model where the module called `name` is."""
        parent, _, attr = name.rpartition(".")
        setattr(self.model.get_submodule(parent), attr, module)

    @functools.cached_property
    def head(self) -> nn.Module:
        """The last of the last stage's modules: the head, whose outputs are the logits."""
        return self.last[next(reversed(self.last))]


def locate(model: nn.Module, plan: ParallelPlan | None = None) -> Located:
    """Find `plan` (default: `plan_for(model)`) in `model`; PlanError where the model does not fit it."""
    plan = plan or plan_for(model)
    named = dict(model.named_modules())
    block_names = [name for name, m in named.items() if type(m).__name__ in plan.blocks]
    if not block_names:
        raise PlanError(f"plan {plan.family}: the model has no module of class {' or '.join(plan.blocks)}")
    layers = block_names[0].rpartition(".")[0]
    if not isinstance(named[layers], nn.ModuleList) or [f"{layers}.{i}" for i in range(len(named[layers]))] \
            != block_names:
        raise PlanError(f"plan {plan.family}: the blocks ({', '.join(block_names[:3])}, ...) must be every entry of "
                        "one nn.ModuleList, in order: a pipeline cuts between its entries")
    outside = {name: m for name, m in named.items()
               if name and name != layers and not name.startswith(f"{layers}.")}

    def find(pattern: str) -> str:
        found = [name for name in outside if matches(name, pattern)]
        if len(found) != 1:
            what = "no module" if not found else f"{len(found)} modules ({', '.join(found)})"
            raise PlanError(f"plan {plan.family}: {pattern!r} matches {what} outside the blocks; expected one")
        return found[0]

    first = {name: outside[name] for name in map(find, plan.first_stage)}
    last = {name: outside[name] for name in map(find, plan.last_stage)}
    for name in first:
        if not isinstance(outside[name], nn.Embedding):
            raise PlanError(f"plan {plan.family}: first_stage module {name!r} is a {type(outside[name]).__name__}; "
                            "the first stage's modules are embeddings (nn.Embedding), which a later stage replaces by "
                            "zeros of their width")
    owned = {id(p) for name in (*first, *last) for p in outside[name].parameters()}
    for name, param in model.named_parameters():
        if not name.startswith(f"{layers}.") and id(param) not in owned:
            raise PlanError(f"plan {plan.family}: parameter {name!r} is outside the blocks and in neither first_stage "
                            "nor last_stage; every stage would hold it and none would train it as one device does")
    return Located(plan, model, [named[name] for name in block_names], layers, first, last)


def find_positions(model: nn.Module) -> tuple[nn.Module, int | str]:
    """The module of `model` that takes its tokens' positions and which argument they are, as its
    family's plan says; PlanError where the plan names none or the model has no such module."""
    plan = plan_for(model)
    if plan.positions is None:
        raise PlanError(f"plan {plan.family}: names no positions (the module that takes the tokens' positions); "
                        "context parallel needs it to give each rank its tokens' global positions")
    found = [m for name, m in model.named_modules() if name and matches(name, plan.positions.module)]
    if len(found) != 1:
        raise PlanError(f"plan {plan.family}: positions module {plan.positions.module!r} matches {len(found)} "
                        "modules; expected one")
    return found[0], plan.positions.argument
