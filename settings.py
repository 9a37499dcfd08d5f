"""A recipe's settings as a small typed tree: frozen dataclasses whose fields say what they may take (`knob`: one of a
few values, a range, whole numbers) and hold the settings of one technique each (`component`: present, or None where
the recipe leaves the technique out). From the tree come the flags (one per field, named after it: --whiten-eps,
--muon-lr, --batch-size), the changes a flag or keyword makes, and the checks, each a UsageError of one line naming
the flag, what is wrong and what is allowed.

A component class names its flags' prefix (PREFIX) and either a field whose value turns it off (OFF: ("momentum",
0.0): --ema-momentum 0 leaves EMA out) or gets a switch of its own (--whiten false); giving any of its fields turns
an absent component on, from its defaults. No torch here.
"""
import argparse
import dataclasses
import math

from core import UsageError


def knob(default, *, choices=None, low=None, high=None, above=None, whole=False, flag=None, doc=None):
    """A setting's default and what it may take: one of `choices` (a tuple, or a dict of named presets whose flag
    takes the name), or a finite number (or a tuple of them) in [low, high], above `above`, whole with whole; `flag`
    names its flag when its component's prefix alone is the natural name (the TTA's views: --tta)."""
    meta = {"choices": choices, "low": low, "high": high, "above": above, "whole": whole, "flag": flag, "doc": doc}
    return dataclasses.field(default=default, metadata=meta)


def numbers(default, **limits):
    """A knob (with knob's keywords) holding a tuple of exactly as many numbers as its default has."""
    f = knob(default, **limits)
    return dataclasses.field(default=default, metadata={**f.metadata, "length": len(default)})


def component(cls, default=None, *, title=None):
    """A field holding a technique's settings, of class cls, or None where the recipe leaves it out; title: its
    flags' heading in --help (default: the field's name)."""
    return dataclasses.field(default=default, metadata={"component": cls, "title": title})


def always_present(default, *, title=None):
    """A field holding settings every recipe has (the network, its batch norm): a component never left out."""
    return dataclasses.field(default=default, metadata={"component": type(default), "always": True, "title": title})


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One setting as the command line sees it: its flag's name (underscores), the path of field names to it, and
    the field, with the classes it sits in."""
    name: str
    path: tuple
    field: dataclasses.Field
    owners: tuple


def leaves(cls, prefix=(), path=(), owners=()):
    """Every setting of a recipe class, in the order of its fields, components' settings included (whether the
    recipe has them or not), and each optional component's switch when it has no OFF field."""
    out = []
    for f in dataclasses.fields(cls):
        sub = f.metadata.get("component")
        if f.name in ("name", "doc", "notes"):         # what a recipe says of itself, not a setting
            continue
        if sub is None:
            name = f.metadata.get("flag") or "_".join([*prefix, f.name])
            out.append(Leaf(name, (*path, f.name), f, owners + (cls,)))
            continue
        sub_prefix = (*prefix, sub.PREFIX) if getattr(sub, "PREFIX", "") else prefix
        if not f.metadata.get("always") and not getattr(sub, "OFF", None):
            out.append(Leaf("_".join(sub_prefix), (*path, f.name), f, owners + (cls,)))       # --whiten true|false
        out += leaves(sub, sub_prefix, (*path, f.name), owners + (cls,))
    return out


def by_name(cls):
    return {leaf.name: leaf for leaf in leaves(cls)}


def get(tree, path):
    for name in path:
        tree = None if tree is None else getattr(tree, name)
    return tree


def show(value):
    """A value as a flag takes it: 0,0.4,0 for a tuple, a preset's name, a number in its shortest form."""
    if isinstance(value, tuple):
        return ",".join(map(show, value))
    if dataclasses.is_dataclass(value) and hasattr(value, "name"):        # a preset
        return value.name
    return f"{value:g}" if isinstance(value, float) else str(value).lower() if isinstance(value, bool) else str(value)


def one_of_text(choices):
    """The values a flag may take, as typed, for a help or an error: "'', relu, celu" ('' for the empty word)."""
    return ", ".join(show(c) or "''" for c in choices)


def exact(value):
    """A value as a flag takes it, exactly: show()'s form where it reads back the same number, else every digit."""
    if isinstance(value, tuple):
        return ",".join(map(exact, value))
    if isinstance(value, float) and float(show(value)) != value:
        return repr(value)
    return show(value)


def flag_error(name, value, why):
    return UsageError(f"--{name.replace('_', '-')} {show(value)}: {why}")


def changed(tree, **changes):
    """The tree with settings changed by flag name (width=0.25, whiten_eps=1e-3, ema_momentum=0, whiten=False); a
    component that a change reaches is made from its defaults when absent; an OFF value or a false switch leaves it
    out. Each class on the way is made once, with every change: a class that checks itself when made (a recipe) sees
    no state between two changes. An unknown name is a UsageError of one line."""
    names = by_name(type(tree))
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise UsageError(f"unknown settings {unknown}; see --help for the flags")
    contradiction_error(names, changes)
    values = field_values(tree)
    for name, value in changes.items():
        put(values, type(tree), names[name].path, value)
    return tree_from(type(tree), values)


def is_switch(leaf):
    return "component" in leaf.field.metadata


def left_out(leaf, value):
    """The path of the component that this change leaves out (a switch set false, an OFF value), or None."""
    if is_switch(leaf):
        return leaf.path if value is False else None
    off = getattr(leaf.owners[-1], "OFF", None)
    return leaf.path[:-1] if off and leaf.path[-1] == off[0] and value == off[1] else None


def contradiction_error(names, changes):
    """Raises UsageError, naming both flags, where the changes set a setting of a technique that another of them
    leaves out (--whiten false --whiten-eps 1e-3), whatever their order; or a switch that is not true or false."""
    for name, value in changes.items():
        if is_switch(names[name]) and not isinstance(value, bool):
            raise flag_error(name, value, f"must be true or false, not {type(value).__name__} {value!r}")
    flag = lambda name: f"--{name.replace('_', '-')} {show(changes[name])}"
    for off_name in changes:
        off = left_out(names[off_name], changes[off_name])
        other = next((n for n in changes if n != off_name and off and names[n].path[:len(off)] == off), None)
        if other:
            raise UsageError(f"{flag(off_name)} leaves out what {flag(other)} sets; give one or the other")


def field_values(tree):
    """{field name: value} of one level of a tree."""
    return {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}


def put(values, cls, path, value):
    """Sets the setting at path in values (the field_values of a tree of class cls, where each component a change
    reaches becomes its own field_values), a component on the way made or left out as changed() says."""
    head, rest = path[0], path[1:]
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}[head]
    sub = meta.get("component")
    if not rest:
        if sub is not None and not meta.get("always"):      # a switch: on (from defaults) or off
            values[head] = (values[head] if values[head] is not None else sub()) if value else None
        else:
            values[head] = value
        return
    off = getattr(sub, "OFF", None)
    if off and rest == (off[0],) and value == off[1]:
        values[head] = None
        return
    current = values[head] if values[head] is not None else sub()
    values[head] = current if isinstance(current, dict) else field_values(current)
    put(values[head], sub, rest, value)


def tree_from(cls, values):
    """The tree of class cls with these field values, each component put() reached (a dict) made from its own."""
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}
    return cls(**{k: tree_from(meta[k]["component"], v) if isinstance(v, dict) else v for k, v in values.items()})


def check(tree, prefix=(), *, own=False):
    """Raises flag_error for the first setting of tree outside what its knob allows, then each component's own
    check() (what depends on several settings at once); with own, tree's own knobs alone (check_own)."""
    for f in dataclasses.fields(tree):
        value = getattr(tree, f.name)
        sub = f.metadata.get("component")
        if f.name in ("name", "doc", "notes"):
            continue
        if sub is not None:
            if value is not None and not own:
                check(value, (*prefix, sub.PREFIX) if getattr(sub, "PREFIX", "") else prefix)
            continue
        m = f.metadata
        name = m.get("flag") or "_".join([*prefix, f.name])
        if m.get("choices") is not None:
            allowed = tuple(m["choices"].values()) if isinstance(m["choices"], dict) else m["choices"]
            if value not in allowed:
                raise flag_error(name, value, f"must be one of {one_of_text(m['choices'])}")
            continue
        kind_error(name, value, f.default)
        number_error(name, value, m)
    if hasattr(tree, "check") and not own:
        tree.check()


def check_own(tree):
    """check() of tree's own knobs, not its components' nor what depends on several settings (a flag changes one at
    a time): cheap enough for a settings class's __post_init__, so that a bad value fails where it is built."""
    check(tree, (tree.PREFIX,) if getattr(tree, "PREFIX", "") else (), own=True)


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def kind_error(name, value, default):
    """Raises flag_error unless value is of its default's kind (true or false, a number, a tuple of numbers): the
    library's keywords are not read from text, so `width="wide"` gets here."""
    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif is_number(default):
        ok, kind = is_number(value), "a number"
    elif isinstance(default, tuple):
        ok, kind = isinstance(value, tuple) and all(map(is_number, value)), "a tuple of numbers"
    else:
        return
    if not ok:
        raise flag_error(name, value, f"must be {kind}, not {type(value).__name__} {value!r}")


def number_error(name, value, m):
    """Raises flag_error unless value (a number, or a tuple of them) is what the knob's metadata m allows: each item
    finite, whole, above and within its bounds, the tuple of its length."""
    items = value if isinstance(value, tuple) else (value,)
    if m.get("length") is not None and len(items) != m["length"]:
        raise flag_error(name, value, f"must be {m['length']} numbers separated by commas")
    for v in items:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if not math.isfinite(v):            # NaN passes every comparison below
            raise flag_error(name, value, "must be a finite number")
        if m.get("whole") and not float(v).is_integer():
            raise flag_error(name, value, "must be a whole number")
        low, high, above = m.get("low"), m.get("high"), m.get("above")
        if above is not None and not v > above:
            raise flag_error(name, value, "must be positive" if above == 0 else f"must be above {show(above)}")
        if low is not None and v < low or high is not None and v > high:
            raise flag_error(name, value, f"must be between {show(low if low is not None else above)} and "
                             f"{show(high)}" if high is not None else "must not be negative" if low == 0
                             else f"must be at least {show(low)}")


# ---------------------------------------------------------------------------------------------------------------
# Flags

def number(s):
    """A number as typed: 3, 0.5, 1e-3 or a fraction such as 1/16."""
    if "/" in s:
        a, b = s.split("/")
        return float(a) / float(b)
    return float(s)


def whole(x):
    """x as an int when it is a whole number, else as it is (1.5, NaN, inf), for the check to name what is wrong."""
    return int(x) if float(x).is_integer() else float(x)


def converter(f):
    """The function from a flag's text to the value of field f (named after the type, for argparse's errors)."""
    default, choices = f.default, f.metadata.get("choices")
    if isinstance(choices, dict):
        convert = lambda s: choices[s]
    elif isinstance(default, bool):
        convert = lambda s: {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[s.lower()]
    elif isinstance(default, tuple):
        ints = f.metadata.get("whole") or default and all(isinstance(v, int) for v in default)
        item = whole if ints else float
        convert = lambda s: tuple(item(number(v)) for v in s.split(",")) if s else ()
    elif isinstance(default, int):        # an integer unless written as a fraction: --epochs 9.9
        convert = lambda s: whole(number(s))
    elif isinstance(default, float):
        convert = lambda s: float(number(s))
    else:
        kind = type(default) if default is not None else str
        convert = lambda s: kind(s)
    convert.__name__ = type(default).__name__ if not isinstance(choices, dict) else "preset"
    return convert


KINDS = {"int": "a whole number", "float": "a number", "tuple": "numbers separated by commas", "bool": "true or false",
         "preset": "a preset", "str": "a word"}


def checked(convert, choices):
    """An argparse type: convert, refusing (one line, naming what is allowed) what it cannot read or what is not one
    of choices."""
    def check(s):
        try:
            value = convert(s)
        except (KeyError, ValueError, ZeroDivisionError):
            if choices:
                raise argparse.ArgumentTypeError(f"{s!r} is not one of {one_of_text(choices)}")
            raise argparse.ArgumentTypeError(f"{s!r} is not {KINDS.get(convert.__name__, convert.__name__)}")
        allowed = tuple(choices.values()) if isinstance(choices, dict) else choices
        if choices is not None and value not in allowed:
            raise argparse.ArgumentTypeError(f"{s!r} is not one of {one_of_text(choices)}")
        return value
    check.__name__ = convert.__name__
    return check


def one_of(choices):
    """An argparse type for a flag that takes one of a few words, refusing any other in one line that names them."""
    return checked(str, tuple(choices))


def add_flags(parser, recipe_class, *, recipe):
    """One flag per setting of recipe_class (--whiten-eps for whiten_eps; a switch takes true or false), under a
    heading per technique, each help saying what the setting does and its value in `recipe` (the default recipe), or
    that the recipe leaves its technique out and the value it takes when turned on."""
    fields = {f.name: f for f in dataclasses.fields(recipe_class)}
    groups = {None: parser.add_argument_group("training settings", f"Each flag from here on changes a setting of the "
                                              f"recipe; the defaults are {recipe.name}'s (--recipe NAME "
                                              "--print-recipe prints another recipe's).")}
    for leaf in leaves(recipe_class):
        top = fields[leaf.path[0]]
        key = top.name if "component" in top.metadata else None
        if key not in groups:
            title = top.metadata.get("title") or key.replace("_", " ")
            groups[key] = parser.add_argument_group(f"{title} settings")
        f = leaf.field
        switch = "component" in f.metadata
        groups[key].add_argument("--" + leaf.name.replace("_", "-"), dest=leaf.name, default=None,
                                 type=checked(converter(dataclasses.field(default=True) if switch else f),
                                              None if switch else f.metadata.get("choices")),
                                 metavar=metavar(f, switch),
                                 help=f"{flag_doc(leaf, switch)} (default: {recipe_value(recipe, leaf)})")


def flag_doc(leaf, switch):
    """What a setting does, for its flag's help: its knob's doc (a switch: its class's docstring, to the first colon),
    with the value that leaves its technique out, if any; else what it takes."""
    if switch:
        return " ".join(leaf.field.metadata["component"].__doc__.split(":")[0].split()) + ", on or off"
    doc = leaf.field.metadata.get("doc") or KINDS[converter(leaf.field).__name__]
    off = getattr(leaf.owners[-1], "OFF", None)
    return doc + (f" ({show(off[1])}: off)" if off and leaf.path[-1] == off[0] else "")


def metavar(f, switch):
    """What a setting's flag takes, in --help: N (whole numbers), X, X,X (a tuple of two), X,... (of any length),
    true|false, or its choices."""
    if switch or isinstance(f.default, bool):
        return "true|false"
    if f.metadata.get("choices") is not None:
        return "{" + ",".join(show(c) or "''" for c in f.metadata["choices"]) + "}"
    if isinstance(f.default, tuple):
        return ",".join(["X"] * f.metadata["length"]) if f.metadata.get("length") else "X,..."
    return "N" if f.metadata.get("whole") else "WORD" if isinstance(f.default, str) else "X"


def recipe_value(recipe, leaf):
    """A setting's value in recipe, for a flag's help: "0,0.4,0", or where the recipe leaves its technique out
    "off; on: 0.01" (the value it takes when turned on); a switch "on" or "off"."""
    if "component" in leaf.field.metadata:
        return "off" if get(recipe, leaf.path) is None else "on"
    off = get(recipe, leaf.path[:-1]) is None
    value = leaf.field.default if off else get(recipe, leaf.path)
    text = "none" if value == () else exact(value) or repr("")
    return f"off; on: {text}" if off else text


def as_flags(tree, *, skip=()):
    """[(flag, value as typed)] that set every setting of tree (a recipe) as it holds it, whatever recipe they are
    given to: a technique left out by its switch or OFF value, numbers exact; settings named in skip left out."""
    out = []
    for leaf in leaves(type(tree)):
        owner, flag = get(tree, leaf.path[:-1]), "--" + leaf.name.replace("_", "-")
        off = getattr(leaf.owners[-1], "OFF", None)
        if leaf.name in skip:
            continue
        if owner is None:               # a technique left out: its OFF value, once (its other settings mean nothing)
            if off and leaf.path[-1] == off[0] and get(tree, leaf.path[:-2]) is not None:
                out.append((flag, exact(off[1])))
        elif "component" in leaf.field.metadata:
            out.append((flag, "false" if get(tree, leaf.path) is None else "true"))
        else:
            out.append((flag, exact(get(tree, leaf.path))))
    return out


def command_text(words, flags):
    """A shell command of words then flags (as_flags), one flag a line: what --print-recipe prints."""
    import shlex
    return " \\\n  ".join([shlex.join(words), *(f"{flag} {shlex.quote(value)}" for flag, value in flags)])


def changes_from(args, recipe_class):
    """The settings a command line gives, by flag name."""
    return {name: getattr(args, name) for name in by_name(recipe_class) if getattr(args, name, None) is not None}


def flat(tree):
    """{flag name: value} of every setting a tree holds (a component it leaves out: its switch, False), for a run's
    record and a checkpoint's check."""
    out = {}
    for leaf in leaves(type(tree)):
        if "component" in leaf.field.metadata:
            out[leaf.name] = get(tree, leaf.path) is not None
            continue
        owner = get(tree, leaf.path[:-1])
        if owner is not None:
            value = getattr(owner, leaf.path[-1])
            out[leaf.name] = show(value) if dataclasses.is_dataclass(value) else value
    return out
