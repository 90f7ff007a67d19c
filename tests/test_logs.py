import ast
from pathlib import Path

import flashoverlap

PACKAGE = Path(flashoverlap.__file__).parent


def _logger_names(tree: ast.AST) -> list[ast.expr]:
    """The arguments of every logging.getLogger(...) call in a module."""
    return [
        node.args[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "getLogger"
        and node.args
    ]


def test_modules_run_with_python_m_log_under_the_package_logger():
    """A module run as ``python -m flashoverlap.x`` is named "__main__": getLogger(__name__) there
    would sit outside the ``flashoverlap`` logger, and its progress lines (INFO) would vanish."""
    runnable = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if 'if __name__ == "__main__"' not in text:
            continue
        runnable.append(path.name)
        for name in _logger_names(ast.parse(text)):
            assert isinstance(name, ast.Constant) and name.value.startswith("flashoverlap."), (
                f"{path.name}: a logger that python -m would name __main__"
            )
    assert "tune.py" in runnable and "bench.py" in runnable
