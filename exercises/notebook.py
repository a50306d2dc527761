"""Notebooks in a student release: a cell that needs an exercise you have not finished is skipped, with a
message saying which, instead of stopping the notebook.

A student release puts one cell at the top of each notebook:

    import exercises.notebook
    exercises.notebook.skip_unfinished_cells()

From then on every cell runs guarded (in Jupyter through IPython's AST transformers; the headless runner of
tests/test_notebooks.py calls ``guard`` itself):

* a cell that fails with ``exercises.Unfinished``, or with a NotImplementedError raised in one of your
  exercise files, prints ``[skipped: ...]`` and the notebook goes on;
* what that cell was to set up (the names it assigns, and the objects it used, which it may have left half
  changed) is marked missing, and a later cell that reads one of them is skipped too, saying so, rather than
  failing with a NameError;
* any other error is raised as usual.

Once your exercises are finished nothing is skipped and the guard changes nothing.
"""
from __future__ import annotations

import ast
import builtins
import inspect
import sys
from pathlib import Path

ACTIVE = False             # skip_unfinished_cells() was called: later cells run guarded
_missing: dict = {}        # name -> why it is missing (the skipped cell it came from)
_last = None               # the value of the guarded cell's last expression (what Jupyter displays)
_MOD = "_minibatch_cell_guard"


def skip_unfinished_cells() -> None:
    """Guard every later cell of this notebook (see the module docstring)."""
    global ACTIVE
    ACTIVE = True
    _missing.clear()
    try:
        ip = get_ipython()                       # noqa: F821  (defined inside IPython and Jupyter only)
    except NameError:
        return
    if not any(isinstance(t, _Guard) for t in ip.ast_transformers):
        ip.ast_transformers.append(_Guard())


def _names(tree: ast.Module) -> tuple[tuple, tuple]:
    """(names the cell reads before it binds them, names it binds), in source order."""
    seen = []                                    # (line, column, name, binds?)
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            seen.append((n.lineno, n.col_offset, n.id, not isinstance(n.ctx, ast.Load)))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            seen.append((n.lineno, n.col_offset, n.name, True))
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            seen += [(n.lineno, n.col_offset, (a.asname or a.name).split(".")[0], True) for a in n.names]
    loads, stores = {}, {}
    for _, _, name, binds in sorted(seen):
        if binds:
            stores[name] = None
        elif name not in stores and not hasattr(builtins, name):
            loads[name] = None
    return tuple(loads), tuple(stores)


def guard(tree: ast.Module) -> ast.Module:
    """The cell ``tree``, guarded: skipped if it reads a missing name; an unfinished exercise skips the rest."""
    if not tree.body:
        return tree
    loads, stores = _names(tree)
    body = list(tree.body)
    last = body[-1]
    if isinstance(last, ast.Expr):               # keep the value Jupyter would display
        body[-1] = ast.Assign(targets=[ast.Attribute(value=ast.Name(_MOD, ast.Load()), attr="_last", ctx=ast.Store())],
                              value=last.value)
    call = lambda fn, *args: ast.Call(ast.Attribute(ast.Name(_MOD, ast.Load()), fn, ast.Load()),  # noqa: E731
                                      [ast.Constant(a) for a in args], [])
    handler = ast.ExceptHandler(
        type=ast.Name("BaseException", ast.Load()), name="_minibatch_error",
        body=[ast.If(test=ast.UnaryOp(ast.Not(), ast.Call(
            ast.Attribute(ast.Name(_MOD, ast.Load()), "_skipped", ast.Load()),
            [ast.Name("_minibatch_error", ast.Load()), ast.Constant(stores), ast.Constant(loads),
             ast.Call(ast.Name("globals", ast.Load()), [], [])], [])),
            body=[ast.Raise()], orelse=[])])
    new = [
        ast.Import([ast.alias("exercises.notebook", asname=_MOD)]),
        ast.Assign(targets=[ast.Attribute(ast.Name(_MOD, ast.Load()), "_last", ast.Store())],
                   value=ast.Constant(None)),
        ast.If(test=call("_runs", loads, stores),
               body=[ast.Try(body=body, handlers=[handler], orelse=[], finalbody=[])], orelse=[]),
        ast.Expr(ast.Attribute(ast.Name(_MOD, ast.Load()), "_last", ast.Load())),
    ]
    out = ast.Module(body=new, type_ignores=[])
    return ast.fix_missing_locations(ast.copy_location(out, tree))


def _runs(loads, stores) -> bool:
    """False (and a message) when the cell reads a name a skipped cell was to set up."""
    gone = [x for x in loads if x in _missing]
    if not gone:
        for x in stores:                         # set again here: no longer missing
            _missing.pop(x, None)
        return True
    print(f"[skipped: this cell uses {', '.join(gone)}, which {_missing[gone[0]]}]")
    for x in stores:
        _missing.setdefault(x, _missing[gone[0]])
    return False


def _unfinished_reason(e: BaseException):
    """Why ``e`` means "an exercise is not finished" (a message), or None."""
    import exercises
    if isinstance(e, exercises.Unfinished):
        return str(e)
    if isinstance(e, NotImplementedError):
        stems = {p.stem: p for p in exercises.PIECES.values()}
        tb = e.__traceback__
        while tb is not None:
            path = Path(tb.tb_frame.f_code.co_filename)
            if path.stem in stems and path.parent.name != "mutants":
                p = stems[path.stem]
                return f"this needs exercise {p.part[2:]} ({p.title}), not finished yet: {e}"
            tb = tb.tb_next
    return None


def _skipped(e: BaseException, stores, loads, namespace) -> bool:
    """True (and a message) when the cell failed for an unfinished exercise; what it touched is then missing."""
    why = _unfinished_reason(e)
    if why is None:
        return False
    print(f"[skipped: {why}]")
    reason = "a cell above could not set up (an exercise is not finished)"
    for x in stores:
        _missing[x] = reason
    for x in loads:                              # objects it used may be half changed; modules, classes, functions not
        v = namespace.get(x)
        if x in namespace and not (inspect.ismodule(v) or inspect.isclass(v) or callable(v)):
            _missing[x] = reason
    return True


class _Guard(ast.NodeTransformer):
    """IPython's hook: every cell's AST goes through ``guard``."""

    def visit_Module(self, node):
        return guard(node)


def is_guarded() -> bool:
    return ACTIVE and "exercises.notebook" in sys.modules
