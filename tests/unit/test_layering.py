"""The one-way dependency rule of DESIGN.md: imports only point down the layer stack."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "src" / "dflash_server"
# package -> packages it must never import
FORBIDDEN = {
    "kernels": {"layers", "models", "runtime", "engine", "server", "cache", "spec", "cli", "weights", "pflash"},
    "layers": {"models", "runtime", "engine", "server", "cache", "spec", "cli", "weights", "pflash"},
    "models": {"runtime", "engine", "server", "cache", "spec", "cli", "weights", "pflash"},
    "runtime": {"engine", "server", "cache", "spec", "cli", "pflash"},
    "weights": {"runtime", "engine", "server", "cache", "spec", "cli", "pflash"},
    "cache": {"engine", "server", "cli", "pflash"},
    "spec": {"engine", "server", "cli", "pflash"},
    "pflash": {"engine", "server", "cli", "cache", "spec"},
    "engine": {"server", "cli"},
}


def _imports(path: Path, pkg: str) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    rel_parts = path.relative_to(PKG).parts
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel_parts[:-1])[: len(rel_parts) - node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = (node.module or "").removeprefix("dflash_server.") if (node.module or "").startswith(
                    "dflash_server") else ""
            if mod:
                out.add(mod.split(".")[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dflash_server."):
                    out.add(a.name.split(".")[1])
    return out


def test_no_upward_imports():
    bad = []
    for pkg, forbidden in FORBIDDEN.items():
        for f in (PKG / pkg).rglob("*.py") if (PKG / pkg).exists() else []:
            hit = _imports(f, pkg) & forbidden
            if hit:
                bad.append(f"{f.relative_to(PKG)} imports {sorted(hit)}")
    assert not bad, bad


def test_server_does_not_import_torch():
    server = PKG / "server"
    for f in server.rglob("*.py") if server.exists() else []:
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f


def test_the_checker_sees_imports():
    assert "layers" in _imports(PKG / "models" / "llama.py", "models")
