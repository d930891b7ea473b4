"""Every numeric config option declares its range once, in its type (``annotated_types``), and
a value outside it is one ValueError naming the dotted key, the range and the value, whether
it comes from a command-line override, an EvalConfig or a config built in Python."""
from __future__ import annotations

import dataclasses
import types
import typing

import pytest
from annotated_types import Ge, Gt, Interval, Le, Lt

from sprpo_lib.agent.engines import GenerationConfig
from sprpo_lib.agent.prompt import AgentConfig
from sprpo_lib.evaluate.sweep import EvalConfig
from sprpo_lib.infra.ranges import check_ranges, constraints, describe
from sprpo_lib.paper import ablations as A
from sprpo_lib.paper import experiments as X
from sprpo_lib.train.config import load_config
from sprpo_lib.train.trainer import main as train_main

#: numeric fields without a range of their own, and why
NO_RANGE = {"EvalConfig.strengths": "the family's range (core.compress.FAMILIES), checked by check_strength",
            "plan.table": "(family, strength) pairs: the family's range, checked by check_strength when evaluated",
            "plan.landscape_grid": "w1 and w2 of the plane, any sign"}


def leaves(t) -> list:
    """The numeric types in a field's type: itself, its optional arm, or a tuple's elements."""
    if typing.get_origin(t) in (types.UnionType, typing.Union):
        return [x for a in typing.get_args(t) if a is not type(None) for x in leaves(a)]
    base = typing.get_args(t)[0] if typing.get_origin(t) is typing.Annotated else t
    if typing.get_origin(base) is tuple:
        return [x for a in typing.get_args(base) if a is not Ellipsis for x in leaves(a)]
    return [t] if base in (int, float) else []


def numeric_fields(obj, where: str = "") -> list[tuple[str, type, str, typing.Any, list]]:
    """(dotted key, owning class, field name, default value, numeric types) of every numeric
    field of the dataclass ``obj`` and of the dataclasses nested in it."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += numeric_fields(value, f"{where}{f.name}.")
        elif leaves(hints[f.name]):
            out.append((where + f.name, type(obj), f.name, value, leaves(hints[f.name])))
    return out


def bad_values(t) -> list:
    """Values just outside each bound the numeric type ``t`` declares."""
    base = typing.get_args(t)[0]
    out = []
    for c in constraints(t):
        b = next(iter(dataclasses.asdict(c).values()))
        out.append({Gt: b, Ge: b - 1, Lt: b, Le: b + 1}[type(c)])
    return [base(v) for v in out]


def shown(value) -> str:
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, tuple) else str(value)


def cases(obj, where: str = "") -> list:
    """(key, owning class, field, bad value, range text) for every bound of every numeric field."""
    out = []
    for key, cls, name, value, kinds in numeric_fields(obj, where):
        if key in NO_RANGE:
            continue
        for i, t in enumerate(kinds):
            for bad in bad_values(t):
                if isinstance(value, tuple):  # one element out of range, the others as they are
                    bad = value[:i] + (bad,) + value[i + 1:]
                out.append(pytest.param(key, cls, name, bad, describe(constraints(t)), id=f"{key}={shown(bad)}"))
    return out


SMOKE = load_config("smoke")
EVAL = EvalConfig(model="tiny-qwen2")


def test_every_numeric_field_declares_a_range():
    fields = numeric_fields(SMOKE) + numeric_fields(EVAL, "EvalConfig.")
    assert len(fields) > 100
    missing = [key for key, _, _, _, kinds in fields if key not in NO_RANGE and not all(map(constraints, kinds))]
    assert missing == [], f"numeric config fields without a declared range: {missing}"


@pytest.mark.parametrize("t,text", [(Gt(0), "> 0"), (Ge(1), ">= 1"), (Le(0), "<= 0"), (Lt(1), "< 1"),
                                    (Interval(gt=0, le=1), "in (0, 1]"), (Interval(ge=0, lt=1), "in [0, 1)"),
                                    (Interval(ge=0, le=2), "in [0, 2]")])
def test_range_text(t, text):
    assert describe(constraints(typing.Annotated[float, t])) == text


@pytest.mark.parametrize("key,cls,name,bad,text", cases(SMOKE))
def test_an_out_of_range_override_names_key_range_and_value(key, cls, name, bad, text):
    with pytest.raises(ValueError) as err:
        load_config("smoke", [f"{key}={shown(bad)}"])
    msg = str(err.value)
    assert msg.startswith(f"{key}={shown(bad)}: out of range; expected ") and text in msg, msg
    example = msg.split("; for example ")[1]
    assert example.startswith(f"{key}=")
    load_config("smoke", [example])  # the example given is a valid value
    with pytest.raises(ValueError) as err:  # a config built in Python: the bare field name
        cls(**{name: bad})
    assert str(err.value).startswith(f"{name}={shown(bad)}: out of range") and text in str(err.value)


@pytest.mark.parametrize("key,cls,name,bad,text", cases(EVAL, "EvalConfig."))
def test_an_out_of_range_eval_option_names_key_range_and_value(key, cls, name, bad, text):
    with pytest.raises(ValueError) as err:
        if cls is AgentConfig:  # a nested option: an AgentConfig changed after it was built
            agent = AgentConfig()
            setattr(agent, name, bad)
            EvalConfig(model="tiny-qwen2", agent=agent).validate()
        else:
            EvalConfig(model="tiny-qwen2", **{name: bad}).validate()
    msg = str(err.value)
    assert msg.startswith(f"{key}={shown(bad)}: out of range; expected ") and text in msg, msg


def test_eval_sampling_options_declare_the_generation_ranges():
    """EvalConfig's sampling options become a GenerationConfig: the same ranges."""
    gen = typing.get_type_hints(GenerationConfig, include_extras=True)
    ev = typing.get_type_hints(EvalConfig, include_extras=True)
    shared = set(gen) & set(ev) - {"seed"}
    assert shared >= {"temperature", "top_p", "max_new_tokens", "batch_size", "max_batched_tokens"}
    assert {k: ev[k] for k in shared} == {k: gen[k] for k in shared}


def test_sprpo_train_says_one_line(capsys):
    assert train_main(["--profile", "smoke", "update.lr=-0.1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "update.lr=-0.1: out of range; expected a number > 0" in err, err


@pytest.mark.parametrize("profile", ["smoke", "cpu", "paper"])
@pytest.mark.parametrize("env", ["webshop", "alfworld"])
def test_every_profile_lies_within_the_ranges(profile, env):
    cfg = load_config(profile, [f"env.name={env}"])
    check_ranges(cfg)
    assert cfg.env.name == env


def test_each_load_is_its_own_config_and_an_edited_profile_is_read_again(tmp_path, monkeypatch):
    """Built configs are memoised: one caller's change never reaches another's config, and a
    profile edited between calls is built from its new text."""
    import sprpo_lib.train.config as C

    monkeypatch.setattr(C, "PROFILES_DIR", tmp_path)
    (tmp_path / "t.yaml").write_text("iterations: 3\nper_env:\n  alfworld: {iterations: 5}\n")
    first = C.load_config("t", ["method.rho=0.1"])
    first.iterations, first.method.rho = 99, 5.0
    again = C.load_config("t", ["method.rho=0.1"])
    assert (again.iterations, again.method.rho) == (3, 0.1) and again is not first
    assert C.load_config("t", ["method.rho=0.1"], **{"env.name": "alfworld"}).iterations == 5
    (tmp_path / "t.yaml").write_text("iterations: 4\n")
    assert C.load_config("t", ["method.rho=0.1"]).iterations == 4
    with pytest.raises(ValueError, match="update.lr=-0.1"):  # an error is raised again, never remembered
        C.load_config("t", ["update.lr=-0.1"])
    with pytest.raises(ValueError, match="update.lr=-0.1"):
        C.load_config("t", ["update.lr=-0.1"])


PLAN = dataclasses.replace(X.plan("smoke", "webshop"), curve_seeds=(0,), longer_seeds=(0,),
                           divergence_curve_seeds=(0,))  # tuples, not None
ABLATION = A.ablation("smoke", "webshop")


def test_the_notebooks_plan_and_ablation_declare_their_ranges():
    fields = numeric_fields(PLAN, "plan.") + numeric_fields(ABLATION, "ablation.")
    missing = [key for key, _, _, _, kinds in fields if key not in NO_RANGE and not all(map(constraints, kinds))]
    assert len(fields) >= 12 and missing == [], f"numeric plan fields without a declared range: {missing}"


@pytest.mark.parametrize("key,cls,name,bad,text", cases(PLAN, "plan.") + cases(ABLATION, "ablation."))
def test_an_out_of_range_plan_field_names_key_range_and_value(key, cls, name, bad, text):
    with pytest.raises(ValueError) as err:  # what a profile's plan section builds
        dataclasses.replace(PLAN if cls is X.Plan else ABLATION, **{name: bad})
    msg = str(err.value)
    assert msg.startswith(f"{key}={shown(bad)}: out of range; expected ") and text in msg, msg
