"""Import a script from tools/ as a module (tools/ is not a package)."""
import importlib.util
import pathlib

TOOLS_DIR = pathlib.Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", TOOLS_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
