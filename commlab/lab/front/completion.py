"""Shell completion scripts made from an argparse parser (``commlab completion bash|zsh``).

The script is static: it is printed once, from the parser's commands, options and choices, and tab
never starts Python. What it completes:

- commands and sub-commands, and each one's options (after ``-``);
- an option's value: its choices (``--state``, ``--comm``, ...), directories for a ``DIR``, files for a
  ``FILE``, nothing for numbers and free text;
- positionals: choices (benchmark names, shells), files for ``SPEC``/``GRID``, run ids (the directories
  in ``$COMMLAB_RUNS``, else ``./runs``) for ``RUN``.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Tuple

SHELLS = ("bash", "zsh")


@dataclass
class Node:
    """One parser in the command tree: ``path`` is ("net", "check") for ``commlab net check``."""
    path: Tuple[str, ...]
    parser: argparse.ArgumentParser
    commands: Dict[str, str] = field(default_factory=dict)  # sub-command -> its one-line summary

    @property
    def name(self) -> str:
        return " ".join(self.path)

    def options(self) -> List[argparse.Action]:
        return [a for a in self.parser._actions if a.option_strings and a.help is not argparse.SUPPRESS]

    def positionals(self) -> List[argparse.Action]:
        return [a for a in self.parser._actions
                if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]


def walk(parser: argparse.ArgumentParser, path: Tuple[str, ...] = ()) -> Iterator[Node]:
    node = Node(path, parser)
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for a in subs:
        for name, sp in a.choices.items():
            node.commands[name] = summary(sp.description or "")
    yield node
    for a in subs:
        for name, sp in a.choices.items():
            yield from walk(sp, path + (name,))


def summary(text: str) -> str:
    first = " ".join(text.split()).split(". ")[0].rstrip(".")
    return first[:1].lower() + first[1:]


def kind(a: argparse.Action) -> str:
    """How a value is completed: choice, dir, file, run, rest (files, after REMAINDER) or none."""
    if a.choices:
        return "choice"
    if a.nargs == argparse.REMAINDER:
        return "rest"
    if a.metavar == "DIR":
        return "dir"
    if a.metavar == "RUN":
        return "run"
    if a.metavar in ("FILE", "SPEC", "GRID"):
        return "file"
    return "none"


def takes_value(a: argparse.Action) -> bool:
    return a.nargs != 0


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    nodes = list(walk(parser))
    return {"bash": bash, "zsh": zsh}[shell](parser.prog, nodes)


# --------------------------------------------------------------------------- bash

def _bash_words(words) -> str:
    return " ".join(words)


def _bash_value(k: str, choices=()) -> str:
    return {"choice": f'COMPREPLY=($(compgen -W "{_bash_words(choices)}" -- "$cur"))',
            "dir": "compopt -o filenames 2>/dev/null; COMPREPLY=($(compgen -d -- \"$cur\"))",
            "file": "compopt -o filenames 2>/dev/null; COMPREPLY=($(compgen -f -- \"$cur\"))",
            "rest": "compopt -o filenames 2>/dev/null; COMPREPLY=($(compgen -f -- \"$cur\"))",
            "run": "COMPREPLY=($(cd \"${runs:-${COMMLAB_RUNS:-runs}}\" 2>/dev/null && compgen -d -- \"$cur\"))",
            "none": "COMPREPLY=()"}[k]


def bash(prog: str, nodes: List[Node]) -> str:
    fn = "_" + prog.replace("-", "_")
    is_cmd, vopts, values, opts, pos = [], [], [], [], []
    for n in nodes:
        for c in n.commands:
            is_cmd.append(f'"{n.name}|{c}"')
        flags = [s for a in n.options() for s in a.option_strings]
        opts.append(f'        "{n.name}") words="{_bash_words(flags)}" ;;')
        for a in n.options():
            if takes_value(a):
                pats = "|".join(f'"{n.name}|{s}"' for s in a.option_strings)
                vopts.append(pats)
                values.append(f"        {pats}) {_bash_value(kind(a), a.choices or ())} ;;")
        i = 0
        if n.commands:
            pos.append(f'        "{n.name}|0") {_bash_value("choice", n.commands)} ;;')
        for a in n.positionals():
            k = kind(a)
            if a.nargs in ("*", "+") or k == "rest":
                pos.append(f'        "{n.name}|"*) {_bash_value(k, a.choices or ())} ;;')
                break
            pos.append(f'        "{n.name}|{i}") {_bash_value(k, a.choices or ())} ;;')
            i += 1
    vpat = "|".join(vopts) or '"-|-"'
    return f"""# bash completion for {prog}: made by `{prog} completion bash` from its parser.
# Install: {prog} completion bash > ~/.local/share/bash-completion/completions/{prog}
#      or: source <({prog} completion bash)   (in ~/.bashrc)
{fn}() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} prev=${{COMP_WORDS[COMP_CWORD-1]}}
    local cmd="" w i npos=0 skip=0 words runs=""
    COMPREPLY=()
    for ((i = 1; i < COMP_CWORD; i++)); do
        w=${{COMP_WORDS[i]}}
        if ((skip)); then skip=0; continue; fi
        case "$w" in --runs=*) runs=${{w#--runs=}} ;; --runs) runs=${{COMP_WORDS[i+1]}} ;; esac
        case "$cmd|$w" in
            {"|".join(is_cmd) or '"-|-"'}) cmd="${{cmd:+$cmd }}$w"; npos=0 ;;
            {vpat}) skip=1 ;;
            *"|-"*) ;;
            *) ((npos++)) ;;
        esac
    done
    if ((skip)); then
        case "$cmd|$prev" in
{chr(10).join(values)}
        esac
        return 0
    fi
    if [[ $cur == -* ]]; then
        case "$cmd" in
{chr(10).join(opts)}
        esac
        COMPREPLY=($(compgen -W "$words" -- "$cur"))
        return 0
    fi
    case "$cmd|$npos" in
{chr(10).join(pos)}
    esac
    return 0
}}
complete -F {fn} {prog}
"""


# --------------------------------------------------------------------------- zsh

def _zq(text: str) -> str:
    """Text for inside a single-quoted _arguments spec: no brackets or colons to end the field early."""
    text = summary(text or "")
    return text.replace("'", "'\\''").replace("[", "(").replace("]", ")").replace(":", ";")


def _zsh_action(k: str, choices=(), fn: str = "") -> str:
    return {"choice": "(" + " ".join(choices) + ")", "dir": "_files -/", "file": "_files", "rest": "_files",
            "run": f"{fn}_run_ids", "none": " "}[k]


def _zsh_option(a: argparse.Action, fn: str) -> List[str]:
    flags = a.option_strings
    excl = f"({' '.join(flags)})" if len(flags) > 1 else ""
    if isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
        excl = "(- *)"
    rep = "*" if isinstance(a, argparse._AppendAction) else ""
    value = ""
    if takes_value(a):
        meta = (a.metavar or a.dest.upper()).replace(":", ";")
        value = f":{meta}:{_zsh_action(kind(a), a.choices or (), fn)}"
    out = []
    for f in flags:
        suffix = ("=" if f.startswith("--") else "+") if takes_value(a) else ""
        out.append(f"'{excl}{rep}{f}{suffix}[{_zq(a.help)}]{value}'")
    return out


def zsh(prog: str, nodes: List[Node]) -> str:
    fn = "_" + prog.replace("-", "_")
    funcs = []
    for n in nodes:
        name = "_".join((fn,) + n.path)
        specs = [s for a in n.options() for s in _zsh_option(a, fn)]
        if n.commands:
            specs += ["'1:command:->command'", "'*::argument:->argument'"]
            cmds = "\n".join(f"        '{c}:{_zq(h)}'" for c, h in n.commands.items())
            cases = "\n".join(f"        {c}) {'_'.join((name, c))} ;;" for c in n.commands)
            body = f"""    local curcontext="$curcontext" state line
    typeset -A opt_args
    _arguments -C \\
        {f' {chr(92)}{chr(10)}        '.join(specs)}
    case $state in
    command)
      local -a commands
      commands=(
{cmds}
      )
      _describe -t commands '{' '.join((prog,) + n.path)} command' commands ;;
    argument)
      case $words[1] in
{cases}
      esac ;;
    esac"""
        else:
            i = 1
            for a in n.positionals():
                k = kind(a)
                meta = (a.metavar or a.dest).replace(":", ";")
                if a.nargs in ("*", "+"):
                    specs.append(f"'*:{meta}:{_zsh_action(k, a.choices or (), fn)}'")
                elif k == "rest":
                    specs.append(f"'*::{meta}:{_zsh_action(k)}'")
                else:
                    opt = ":" if a.nargs == "?" else ""
                    specs.append(f"'{i}:{opt}{meta}:{_zsh_action(k, a.choices or (), fn)}'")
                    i += 1
            body = "    _arguments -s \\\n        " + " \\\n        ".join(specs)
        funcs.append(f"{name}() {{\n{body}\n}}\n")
    return f"""#compdef {prog}
# zsh completion for {prog}: made by `{prog} completion zsh` from its parser.
# Install: {prog} completion zsh > "${{fpath[1]}}/_{prog}"   (a folder on $fpath, before compinit)
#      or: source <({prog} completion zsh)   (in ~/.zshrc, after compinit)

{fn}_run_ids() {{
    # run ids: the directories in --runs, else $COMMLAB_RUNS, else ./runs
    local dir=${{opt_args[--runs]:-${{COMMLAB_RUNS:-runs}}}}
    [[ -d $dir ]] && _path_files -W "$dir" -/
}}

{chr(10).join(funcs)}
if [ "$funcstack[1]" = "{fn}" ]; then
    {fn} "$@"
else
    compdef {fn} {prog}
fi
"""
