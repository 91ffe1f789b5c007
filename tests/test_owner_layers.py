"""The owner's side of service mode is one core with an adapter per framework on top (`tfe_estimator.owner`):
the core never imports an adapter, so Estimator's hooks and Keras' steps sit on the same code, not on copies."""
import ast
import pathlib

import pytest

OWNER = pathlib.Path(__file__).resolve().parent.parent / "tfe_estimator" / "owner"
ADAPTERS = {"estimator", "saver", "keras_fit", "keras_evaluation", "custom_loop", "keras_build", "keras_frames",
            "keras_progress"}


def _imported_owner_modules(source: str):
    """The `tfe_estimator.owner` modules `source` imports (at the top or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "tfe_estimator.owner":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("tfe_estimator.owner."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("tfe_estimator.owner."))
    return found


def _core_importing_adapters():
    bad = {}
    for path in sorted(OWNER.glob("*.py")):
        if path.stem in ADAPTERS or path.stem == "__init__":
            continue
        up = _imported_owner_modules(path.read_text()) & ADAPTERS
        if up:
            bad[path.stem] = sorted(up)
    return bad


def test_the_owner_core_imports_no_framework_adapter():
    assert OWNER.is_dir() and len(list(OWNER.glob("*.py"))) > len(ADAPTERS) + 1
    assert _core_importing_adapters() == {}, (
        "a core module of tfe_estimator.owner imports a framework adapter: move the framework's part into the "
        "adapter (a ServiceExtended subclass, or a hook the adapter sets), so both frameworks share the core")


def test_mutation_a_core_module_reaching_up_to_keras_is_caught(monkeypatch):
    original = pathlib.Path.read_text

    def planted(path, *args, **kwargs):
        text = original(path, *args, **kwargs)
        if path.name == "service_strategy.py":
            text += "\n\ndef _planted():\n    from tfe_estimator.owner import keras_fit  # noqa\n"
        return text

    monkeypatch.setattr(pathlib.Path, "read_text", planted)
    with pytest.raises(AssertionError, match="imports a framework adapter"):
        test_the_owner_core_imports_no_framework_adapter()
