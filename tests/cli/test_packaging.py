"""backends/ installs under the import name parcomp_backends (a PyPI 'backends' exists)."""
import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _py(code, cwd, env=None, flags=()):
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def test_editable_install_imports_from_outside_the_repo(tmp_path):
    r = _py("import parcomp_backends, parcomp; print(parcomp_backends.__file__)", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == os.path.join(ROOT, "backends", "__init__.py")


def test_regular_install_has_parcomp_backends_and_no_backends(tmp_path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    ROOT, "-w", str(wheel_dir)], check=True, capture_output=True, timeout=120)
    (whl,) = list(wheel_dir.glob("parcomp-*.whl"))
    names = zipfile.ZipFile(whl).namelist()
    assert "parcomp_backends/torch/emit/__init__.py" in names
    assert not any(n.startswith("backends/") for n in names)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    str(whl)], check=True, capture_output=True, timeout=120)
    # -S: no site-packages, so the editable finder cannot answer; only the installed copy can
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = _py("import parcomp_backends; print(parcomp_backends.__file__)", str(tmp_path), env, flags=("-S",))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(target / "parcomp_backends" / "__init__.py")


def test_every_package_folder_is_in_the_wheel():
    """pyproject.toml lists the packages by hand (backends/ installs as parcomp_backends): every
    folder with an ``__init__.py`` under parcomp/ and backends/ is in that list."""
    import tomllib
    from pathlib import Path

    listed = set(tomllib.loads(Path(ROOT, "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("parcomp", "parcomp"), ("backends", "parcomp_backends")):
        for init in Path(ROOT, top).rglob("__init__.py"):
            rel = init.parent.relative_to(Path(ROOT, top)).parts
            found.add(".".join((name, *rel)))
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
