"""--kv-cache-dir pointed at folders that are not (only) a cache: a home folder, a shared
1777 folder, one owned by another user, a file. Nothing outside the cache's own files is
ever removed or re-moded, and an unusable folder is a clear error."""
import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_server.cache.disk import DiskCache
from dflash_server.cache.disk_layout import MARKER

IDS = tuple(range(1, 40))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "dflash_server", "cache", *args], capture_output=True, text=True,
                          timeout=120)


def make_cache(root: Path, fp: str = "fp", n: int = 2) -> DiskCache:
    c = DiskCache(root, fp, 1 << 30)
    for i in range(n):
        c.save(IDS[: 10 + i], {"ls0.kv_k.0": torch.full((1, 2, 10 + i, 4), float(i))}, force=True)
    c.flush()
    return c


def tree(root: Path) -> dict:
    """Every path under root with its kind, mode and content (to prove nothing changed)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode),
                                         p.read_bytes() if p.is_file() and not p.is_symlink() else None)
    return out


def home_like(root: Path) -> None:
    (root / "Documents").mkdir(parents=True)
    (root / "Documents" / "thesis.txt").write_text("years of work")
    (root / "project" / ".git").mkdir(parents=True)
    (root / "project" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "project" / "main.py").write_text("print('hi')\n")
    (root / "0123456789abcdef0123").mkdir()  # named like a fingerprint folder, holds user files
    (root / "0123456789abcdef0123" / "notes.md").write_text("mine")
    (root / ".bashrc").write_text("export X=1\n")


def test_clear_refuses_a_folder_that_is_not_a_cache(tmp_path):
    home_like(tmp_path)
    before = tree(tmp_path)
    r = cli("clear", "--kv-cache-dir", str(tmp_path))
    assert r.returncode != 0 and "not a dflash-server cache" in r.stderr and "nothing was changed" in r.stderr
    assert tree(tmp_path) == before
    for action in ("ls", "stats"):
        r = cli(action, "--kv-cache-dir", str(tmp_path))
        assert r.returncode != 0 and "not a dflash-server cache" in r.stderr
    assert tree(tmp_path) == before


def test_clear_removes_only_the_caches_own_files(tmp_path):
    """A cache that shares its folder with user files (a home folder given to serve):
    snapshot files and their folders go, everything else stays byte for byte."""
    home_like(tmp_path)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "keep.bin").write_bytes(b"\x00" * 10)
    c = make_cache(tmp_path, "aaaaaaaaaaaaaaaaaaaa")
    make_cache(tmp_path, "bbbbbbbbbbbbbbbbbbbb")
    (c.dir / "user-file.txt").write_text("put here by hand")     # inside a model folder
    (c.dir / "x.snap.safetensors").write_text("not ours")          # our suffix, not our name
    (tmp_path / "cccccccccccccccccccc").symlink_to(other)          # a symlink named like a folder
    snaps = sorted(tmp_path.glob("*/*.snap.safetensors"))
    assert len([s for s in snaps if s.name != "x.snap.safetensors"]) == 4
    before = {k: v for k, v in tree(tmp_path).items() if not k.startswith(("aaaa", "bbbb"))}
    r = cli("clear", "--kv-cache-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "removed 4 snapshot files and 1 model folders" in r.stdout and "left 2 files" in r.stdout
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith(("aaaa", "bbbb"))} == before
    assert not (tmp_path / "bbbbbbbbbbbbbbbbbbbb").exists()
    assert sorted(p.name for p in c.dir.iterdir()) == [MARKER, "user-file.txt", "x.snap.safetensors"]
    assert (other / "keep.bin").read_bytes() == b"\x00" * 10
    ls = json.loads(cli("ls", "--json", "--kv-cache-dir", str(tmp_path)).stdout)
    assert ls == []


def test_clear_of_an_empty_or_fresh_folder(tmp_path):
    r = cli("clear", "--kv-cache-dir", str(tmp_path))
    assert r.returncode == 0 and "removed 0 snapshot files" in r.stdout
    r = cli("clear", "--kv-cache-dir", str(tmp_path / "missing"))
    assert r.returncode != 0 and "no such directory" in r.stderr


def test_existing_folder_keeps_its_mode_and_owner(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "someone-elses.txt").write_text("x")
    make_cache(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert stat.S_IMODE((shared / "fp").stat().st_mode) == 0o700  # created by the cache: private
    open_again = DiskCache(shared, "fp", 1 << 30)
    assert not open_again.read_only and len(open_again.index.entries) == 2
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert (shared / MARKER).is_file() and (shared / "fp" / MARKER).is_file()


def _as_other_user(fn):
    """fn() in a child process that cannot write the folders this process made: as root,
    a forked child becomes ``nobody``; otherwise the caller has made them read-only."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 0
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            out = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out, code = {"error": f"{type(e).__name__}: {e}"}, 1
        os.write(w, json.dumps(out).encode())
        os.close(w)
        os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def test_folder_of_another_user_is_used_read_only(tmp_path_factory, caplog):
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="dflash-ro-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        root = base / "cache"
        root.mkdir(mode=0o755)
        os.chmod(root, 0o755)
        make_cache(root)
        os.chmod(root / "fp", 0o755)
        for f in (root / "fp").iterdir():
            os.chmod(f, 0o644)
        if os.geteuid() != 0:
            os.chmod(root / "fp", 0o555)
            os.chmod(root, 0o555)
        before = tree(root)

        def use():
            records = []
            handler = logging.Handler()
            handler.emit = records.append
            logging.getLogger("dflash_server.cache").addHandler(handler)
            c = DiskCache(root, "fp", 1 << 30)
            hit = c.lookup(IDS[:11], range(1, 12))
            wrote = c.save(IDS[:20], {"ls0.kv_k.0": torch.zeros(1, 2, 20, 4)}, force=True)
            c.close()
            other = DiskCache(root, "other-model", 1 << 30)  # nothing for this model: an empty cache
            return {"read_only": c.read_only, "hit": hit is not None and tuple(hit[0].token_ids) == IDS[:11],
                    "wrote": wrote is not None, "warnings": [r.getMessage() for r in records],
                    "other": [other.read_only, len(other.index.entries)]}

        out = _as_other_user(use)
        assert "error" not in out, out
        assert out["read_only"] and out["hit"] and not out["wrote"]
        # one warning per cache opened, naming the folder
        assert [w.split(" is not writable")[0] for w in out["warnings"]] == [
            f"kv cache: {root / 'fp'}", f"kv cache: {root / 'other-model'}"]
        assert out["other"] == [True, 0]
        if os.geteuid() != 0:
            os.chmod(root, 0o755)
            os.chmod(root / "fp", 0o755)
            before = {k: (v[0], 0o755 if k == "fp" else v[1], v[2]) for k, v in before.items()}
        assert tree(root) == before  # not re-moded, not touched, nothing written
    finally:
        subprocess.run(["rm", "-rf", str(base)])


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_unusable_folder_is_a_clear_error(tmp_path, where):
    f = tmp_path / "a-file"
    f.write_text("x")
    target = f if where == "file" else f / "cache"
    with pytest.raises(OSError) as e:
        DiskCache(target, "fp", 1 << 30)
    assert str(target if where == "file" else target) in str(e.value)
    assert "not a directory" in str(e.value) or "choose another --kv-cache-dir" in str(e.value)
    assert f.read_text() == "x"


def test_ls_checks_tensor_data(tmp_path):
    """A file whose tensor bytes were flipped (its header intact) is listed as invalid,
    as the server would treat it; --quick reads headers only."""
    c = make_cache(tmp_path, n=1)
    f = next(c.dir.glob("*.snap.safetensors"))
    data = bytearray(f.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    f.write_bytes(bytes(data))
    rows = json.loads(cli("ls", "--json", "--kv-cache-dir", str(tmp_path)).stdout)
    assert [r["valid"] for r in rows] == [False]
    stats = json.loads(cli("stats", "--json", "--kv-cache-dir", str(tmp_path)).stdout)
    assert stats["models"]["fp"]["invalid"] == 1
    quick = json.loads(cli("ls", "--json", "--quick", "--kv-cache-dir", str(tmp_path)).stdout)
    assert [r["valid"] for r in quick] == [True]


def _shared_root() -> Path:
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="dflash-shared-", dir="/tmp"))
    os.chmod(base, 0o1777)  # like /tmp: anyone may create entries
    return base


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a second user: the tests run as root here and in CI")
def test_another_users_model_folder_is_never_read(caplog):
    """In a shared root anyone can create the predictable fingerprint folder first and
    plant snapshots: a folder of another (non-root) user is ignored with a warning."""
    root = _shared_root()
    try:
        def plant():  # as nobody: a full cache for this fingerprint, world-readable
            c = make_cache(root, "fp")
            os.chmod(c.dir, 0o755)
            for f in c.dir.iterdir():
                os.chmod(f, 0o644)
            return len(c.index.entries)
        assert _as_other_user(plant) == 2
        assert (root / "fp").stat().st_uid == 65534
        caplog.set_level(logging.WARNING, logger="dflash_server.cache")
        c = DiskCache(root, "fp", 1 << 30)
        assert c.ignored and c.read_only and len(c.index.entries) == 0
        assert c.lookup(IDS[:11], range(1, 12)) is None and c.save(IDS, {"x": torch.zeros(1)}, force=True) is None
        assert any("belongs to another user" in r.getMessage() for r in caplog.records)
        # cache clear leaves another user's folder alone
        r = cli("clear", "--kv-cache-dir", str(root))
        assert r.returncode == 0 and len(list((root / "fp").glob("*.snap.safetensors"))) == 2
    finally:
        subprocess.run(["rm", "-rf", str(root)])


def test_group_writable_folder_of_root_is_not_trusted():
    from dflash_server.cache.disk_layout import trusted

    def st(uid, mode):
        return os.stat_result((stat.S_IFDIR | mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))
    me = 1000  # an ordinary user
    assert trusted(st(me, 0o700), me) and trusted(st(me, 0o777), me)   # one's own, whatever the mode
    assert trusted(st(0, 0o755), me) and not trusted(st(0, 0o775), me) and not trusted(st(0, 0o757), me)
    assert not trusted(st(1001, 0o755), me) and not trusted(st(1001, 0o700), me)
    assert trusted(st(0, 0o777), 0)  # root's own folders are root's


def test_marker_links_are_not_followed(tmp_path):
    victim = tmp_path / "victim"
    root = tmp_path / "cache"
    root.mkdir()
    fp = "cccccccccccccccccccc"
    (root / ".dflash-cache").symlink_to(victim)          # a dangling link planted as the marker
    (root / fp).mkdir(mode=0o700)
    (root / fp / ".dflash-cache").symlink_to(tmp_path / "victim2")
    make_cache(root, fp)
    assert not victim.exists() and not (tmp_path / "victim2").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ("d" * 32 + ".snap.safetensors")).write_text("not the cache's")
    (root / "aaaaaaaaaaaaaaaaaaaa").symlink_to(elsewhere)  # a model folder as a link
    r = cli("clear", "--kv-cache-dir", str(root))
    assert r.returncode == 0 and "removed 2 snapshot files" in r.stdout, r.stdout + r.stderr
    assert (root / "aaaaaaaaaaaaaaaaaaaa").is_symlink() and len(list(elsewhere.iterdir())) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a second user: the tests run as root here and in CI")
def test_ls_and_clear_in_a_root_with_private_folders_of_others():
    """A shared root holding another user's private (0700) model folder: ls / stats /
    clear of this user's cache still work, as that other user (a forked child)."""
    root = _shared_root()
    try:
        make_cache(root, "aaaaaaaaaaaaaaaaaaaa")           # root's, 0700: private to root
        os.chmod(root / "aaaaaaaaaaaaaaaaaaaa", 0o700)

        def mine():
            from types import SimpleNamespace

            from dflash_server.cli.cache import run
            make_cache(root, "bbbbbbbbbbbbbbbbbbbb")
            for action in ("ls", "stats", "clear"):
                run(SimpleNamespace(action=action, kv_cache_dir=str(root), json=True, quick=False))
            return sorted(p.name for p in root.iterdir())
        left = _as_other_user(mine)
        assert "error" not in left, left
        assert "bbbbbbbbbbbbbbbbbbbb" not in left and "aaaaaaaaaaaaaaaaaaaa" in left  # only its own went
        assert len(list((root / "aaaaaaaaaaaaaaaaaaaa").glob("*.snap.safetensors"))) == 2
    finally:
        subprocess.run(["rm", "-rf", str(root)])


def test_clear_json_is_one_json_object(tmp_path):
    """Hostile review (2026-11-27): `cache clear --json` printed the plain-text line."""
    make_cache(tmp_path, "fp", n=2).close()
    (tmp_path / "fp" / "mine.txt").write_text("user file")
    r = cli("clear", "--json", "--kv-cache-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["removed_files"] == 2 and got["removed_model_dirs"] == 0 and len(got["kept"]) == 1
