"""Config fields that carry their own flag, type, choices and range: one source for a setting.

A strategy's config dataclass declares each setting once::

    @dataclass
    class DiLoCoConfig(OuterConfig):
        lr: float = flag_field(0.7, flag="outer-lr", low=0.0, low_open=True)
        \"\"\"Outer SGD learning rate on θ_outer (the DiLoCo paper's 0.7).\"\"\"

and everything else reads it from there:

* the field's docstring is its one description: the flag's help and the README's flag table
  (``field_docs`` reads it from the class source, as megatron.training's ``ArgumentGroupFactory``
  does; a field made by a shared helper may carry it as ``doc``); a field without one is refused;
* ``check_fields(config)`` (run first by ``OuterConfig.validate``) refuses a value of the wrong
  type, outside ``choices`` or outside the range, with a ``ConfigError`` naming the field and a fix;
* ``check_given(config, given)`` refuses a field that was set explicitly although the config
  ignores it in its current mode (``requires={"compress": True}``: the field only applies when
  ``compress`` is True);
* the Megatron integration (``megatron_sparseloco.megatron.args.flags``) builds one
  ``--sparseloco-<flag>`` argument per distinct ``flag`` over all registered configs, and reads a
  config back from parsed arguments through the same metadata.

A field declared with ``config_field`` (no ``flag``) gets the same checks but no command-line flag.
The metadata lives under the key ``"sparseloco"`` of ``dataclasses.field(metadata=...)``. This
module knows nothing about Megatron or argparse: a flag here is only a name.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import re
import textwrap
from typing import Any, Collection, Dict, Iterator, Mapping, Optional, Sequence, Tuple

META_KEY = "sparseloco"


class ConfigError(ValueError):
    """An invalid outer-strategy configuration; the message names the field and the fix.

    ``field``: the offending field's name (None when no single field is to blame); ``problem``: what
    is wrong (starts with the field name); ``fix``: what to do, where other fields are written in
    backticks (``\\`momentum=0.9\\```) so the command-line layer can render them as flags.
    """

    def __init__(self, problem: str, field: Optional[str] = None, fix: Optional[str] = None):
        self.problem, self.field, self.fix = problem, field, fix
        text = render_refs(problem, _in_words)
        if field is not None and not problem.startswith(field):
            text = f"{field}: {text}"      # the Python layer names the field (the flag layer names the flag)
        if fix is not None:
            text = f"{text}; fix: {render_refs(fix, _in_words)}"
        super().__init__(text)


def _in_words(name: str, value: Optional[str]) -> str:
    """A backticked field reference as the Python layer shows it: ``inner steps``, ``momentum=0.9``."""
    return name.replace("_", " ") if value is None else f"{name}={value}"


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """What the metadata of one config field says (see ``flag_field``)."""

    name: str
    default: Any
    type: type
    flag: Optional[str] = None
    help: str = ""
    choices: Optional[Tuple[Any, ...]] = None
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    requires: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    store_true: bool = False

    def range_text(self) -> str:
        lo, hi = _num(self.low), _num(self.high)
        if self.low is not None and self.high is not None:
            return f"{'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {lo}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {hi}"
        return ""


def _num(x) -> str:
    return str(int(x)) if isinstance(x, (int, float)) and float(x).is_integer() else f"{x:g}" if x is not None else ""


def config_field(default, *, type: Optional[type] = None, choices: Optional[Sequence] = None,
                 low: Optional[float] = None, high: Optional[float] = None, low_open: bool = False,
                 high_open: bool = False, requires: Optional[Mapping[str, Any]] = None, flag: Optional[str] = None,
                 store_true: bool = False, doc: Optional[str] = None):
    """A dataclass field whose type, choices and range ``check_fields`` enforces.

    ``type`` defaults to the default's type (bool, int, float or str); ``choices`` is the set of
    allowed values; ``low``/``high`` bound a number (closed unless ``low_open``/``high_open``);
    ``requires`` maps other fields to the value they must have for this one to apply (set
    explicitly otherwise: refused by ``check_given``). ``flag`` (see ``flag_field``) names the
    command-line setting; ``store_true``: a bool flag that can only be switched on. ``doc`` describes a
    field made by a helper that several configs share (the codec's, the outer SGD's); a docstring under
    the field in the class overrides it (where an algorithm gives the setting another meaning).
    """
    kind = type if type is not None else builtins_type(default)
    meta = dict(type=kind, flag=flag, help=help_text(doc or ""), choices=None if choices is None else tuple(choices),
                low=low, high=high, low_open=low_open, high_open=high_open, requires=dict(requires or {}),
                store_true=store_true)
    return dataclasses.field(default=default, metadata={META_KEY: meta})


def flag_field(default, *, flag: str, **kw):
    """``config_field`` with a command-line flag ``flag`` (``--sparseloco-<flag>``); the field's docstring is
    its help.

    Several configs may declare the same flag (e.g. ``outer-lr`` for DiLoCo and SparseLoCo), each
    with its own default and docstring; type and kind of flag must agree.
    """
    return config_field(default, flag=flag, **kw)


def builtins_type(default) -> type:
    for t in (bool, int, float, str):
        if isinstance(default, t):
            return t
    raise TypeError(f"config_field: give type= for a default of type {type(default).__name__}")


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> Optional[Dict[str, str]]:
    """name → docstring (the string literal right after the field's annotated assignment) of the fields of
    ``cls`` and its dataclass bases, from the class that declares the field last (a field declared again
    without a docstring has none); None where a class's source cannot be read (no ``.py`` files)."""
    docs: Dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            return None
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:] + [None]):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            docs.pop(node.target.id, None)
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
            if isinstance(doc, str):
                docs[node.target.id] = doc
    return docs


def help_text(doc: str) -> str:
    """A field docstring as one line of help: whitespace collapsed, ````literal```` marks dropped."""
    return " ".join(doc.replace("``", "").split())


def field_specs(config_or_class) -> Iterator[FieldSpec]:
    """The ``FieldSpec`` of every field declared with ``config_field`` / ``flag_field``, in order; ``help``
    is the field's docstring, else its ``doc`` (``help_text``). A declared field with neither raises
    TypeError."""
    cls = config_or_class if isinstance(config_or_class, type) else type(config_or_class)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(META_KEY)
        if meta is None:
            continue
        if docs is not None and f.name in docs:
            meta = {**meta, "help": help_text(docs[f.name])}
        elif docs is not None and not meta["help"]:
            raise TypeError(f"{cls.__name__}.{f.name}: a config field needs a docstring (the line after it), "
                            "which is its description and its flag's help")
        yield FieldSpec(name=f.name, default=f.default, **meta)


def flagged_fields(config_or_class) -> Dict[str, FieldSpec]:
    """flag → spec for the fields that have a command-line flag."""
    return {s.flag: s for s in field_specs(config_or_class) if s.flag is not None}


_TYPE_WORDS = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}


def check_value(spec: FieldSpec, value) -> None:
    """Refuse ``value`` for ``spec`` (wrong type, not a choice, out of range) with a ConfigError."""
    ok_type = {bool: lambda v: isinstance(v, bool),
               int: lambda v: isinstance(v, int) and not isinstance(v, bool),
               float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
               str: lambda v: isinstance(v, str)}.get(spec.type, lambda v: True)
    if value is None and spec.default is None:
        return
    example = f"e.g. the default `{spec.name}={spec.default!r}`" if spec.default is not None else "another value"
    if not ok_type(value):
        raise ConfigError(f"{spec.name} must be {_TYPE_WORDS.get(spec.type, spec.type.__name__)}, got {value!r}",
                          spec.name, f"use {example}")
    if spec.choices is not None and value not in spec.choices:
        raise ConfigError(f"{spec.name} must be one of {spec.choices}, got {value!r}", spec.name,
                          f"use one of {', '.join(repr(c) for c in spec.choices)}")
    lo_bad = spec.low is not None and (value <= spec.low if spec.low_open else value < spec.low)
    hi_bad = spec.high is not None and (value >= spec.high if spec.high_open else value > spec.high)
    if lo_bad or hi_bad:
        rng = spec.range_text()
        raise ConfigError(f"{spec.name} must be {'in ' if rng[0] in '([' else ''}{rng}, got {value!r}", spec.name,
                          f"use a value {'in ' if rng[0] in '([' else ''}{rng}, {example}")


def check_fields(config) -> None:
    """``check_value`` on every declared field of ``config``."""
    for spec in field_specs(config):
        check_value(spec, getattr(config, spec.name))


def check_given(config, given: Collection[str]) -> None:
    """Refuse a field set explicitly (``given``: field names) that ``config`` ignores in its mode."""
    for spec in field_specs(config):
        if spec.name not in given:
            continue
        for other, needed in spec.requires.items():
            if getattr(config, other) != needed:
                raise ConfigError(f"{spec.name} only applies with {other}={needed!r}", spec.name,
                                  f"set `{other}={needed!r}`, or leave `{spec.name}` unset")


_REF = re.compile(r"`(\w+)(?:=([^`]*))?`")


def render_refs(text: str, render) -> str:
    """Replace each backticked reference (```name``` or ```name=value```) with ``render(name, value)``
    (value None for a bare name); ``render`` returns None to keep the reference as written."""

    def sub(m):
        out = render(m.group(1), m.group(2))
        return m.group(0) if out is None else out

    return _REF.sub(sub, text)
