"""The function a config names (grpo.config.keys.function_path): 'file.py:function', 'pkg.module:function'
or an in-process '<python>:function', with a UserError that says what is missing and where."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from grpo.utils.errors import UserError
from grpo.utils.function_forms import FILE_FUNCTION, IN_PROCESS_PREFIX


def import_function(where: str, path: str) -> Callable[..., Any]:
    """The callable `path` names; a relative file path is from the working directory (config files
    have made theirs absolute already, grpo.config.keys.relative_paths)."""
    if path.startswith(IN_PROCESS_PREFIX):
        from grpo.utils.in_process import is_registered, lookup

        if not is_registered(path):
            raise UserError(
                f"{where}: {path} was given to grpo.train in another process; name a file or module"
            )
        fn = lookup(path)
        if not callable(fn):
            raise UserError(f"{where}: {path} is a {type(fn).__name__}, not a function")
        return fn
    file_form = FILE_FUNCTION.match(path)
    if file_form is not None:
        file = Path(file_form["file"]).expanduser().absolute()
        module, shown = import_file(where, file), str(file)
    else:
        shown = path.partition(":")[0]
        module = _import_module(where, shown)
    attr = path.rpartition(":")[2]
    fn = getattr(module, attr, None)
    if fn is None:
        functions = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        close = difflib.get_close_matches(attr, functions, n=1, cutoff=0.6)
        hint = f"did you mean {shown}:{close[0]}? " if close else ""
        raise UserError(
            f"{where}: {shown} has no attribute {attr!r}; {hint}its functions: {', '.join(functions) or 'none'}"
        )
    if not callable(fn):
        raise UserError(f"{where}: {shown}:{attr} is a {type(fn).__name__}, not a function")
    return fn


def _import_module(where: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if isinstance(exc, ModuleNotFoundError) and missing and module_name.startswith(missing):
            raise UserError(
                f"{where}: no module named {missing!r}; name a file ('rewards.py:function', relative to the "
                "YAML file), put the module next to the YAML file, or install it / put its folder on PYTHONPATH"
            ) from exc
        raise UserError(
            f"{where}: importing {module_name} failed ({type(exc).__name__}: {exc}); install what it needs"
        ) from exc


def import_file(where: str, file: Path) -> ModuleType:
    """The module of a .py file, imported under its own name (`pkg.module` inside a package) with the
    folder above it on sys.path, so that the file's imports of its neighbours work and importing it
    twice gives one module; under a name of its own when that name is another module's already."""
    if not file.is_file():
        raise UserError(
            f"{where}: file {file} does not exist; fix the path (a relative one is from the YAML file's folder)"
        )
    root, name = _root_and_name(file)
    module = sys.modules.get(name)
    if module is not None and _is_file_of(module, file):
        return module
    if module is None:
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        module = _run_import(where, file, lambda: importlib.import_module(name))
        if _is_file_of(module, file):
            return module
    # A file named like a module imported already (math.py, a second rewards.py)
    own_name = f"{name.replace('.', '_')}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if own_name in sys.modules:
        return sys.modules[own_name]
    spec = importlib.util.spec_from_file_location(own_name, file)
    assert spec is not None and spec.loader is not None, file
    module = importlib.util.module_from_spec(spec)
    sys.modules[own_name] = module
    loader = spec.loader

    def execute() -> ModuleType:
        loader.exec_module(module)
        return module

    try:
        return _run_import(where, file, execute)
    except UserError:
        del sys.modules[own_name]
        raise


def _run_import(where: str, file: Path, load: Callable[[], ModuleType]) -> ModuleType:
    try:
        return load()
    except ImportError as exc:
        raise UserError(
            f"{where}: importing {file} failed ({type(exc).__name__}: {exc}); install what it needs"
        ) from exc


def _root_and_name(file: Path) -> tuple[Path, str]:
    """The folder to import `file` from and its module name there: above every package folder (one
    with an __init__.py) that holds it."""
    parts = [file.stem]
    folder = file.parent
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        parts.insert(0, folder.name)
        folder = folder.parent
    if parts[-1] == "__init__":
        parts.pop()
    return folder, ".".join(parts)


def _is_file_of(module: ModuleType, file: Path) -> bool:
    origin = getattr(module, "__file__", None)
    return origin is not None and Path(origin).resolve() == file.resolve()
