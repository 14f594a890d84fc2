"""runtime.heap.settle (after a model is loaded): what loading left as garbage is collected, not frozen forever;
what is alive is frozen, so later full collections do not scan it."""
import subprocess
import sys
import textwrap


def test_loading_garbage_is_collected_and_the_rest_frozen():
    # in a child interpreter: a freeze in the test process would keep every later test's objects
    code = textwrap.dedent("""
        import gc, weakref
        from dflash_server.runtime import heap

        class Node:
            pass

        gc.disable()                     # (no collection may happen before settle's own)
        alive = [Node() for _ in range(50_000)]
        cycle = Node(); cycle.me = cycle
        gone = weakref.ref(cycle)
        del cycle
        heap.settle()
        assert gone() is None, "a cycle left by loading must be collected, not frozen"
        assert gc.get_freeze_count() >= len(alive)
        # a full collection walks gc.get_objects(): none of the frozen objects is among them
        assert len(gc.get_objects()) < 100
        heap.thaw()                      # (a reload: the old model's objects may go again)
        assert gc.get_freeze_count() == 0 and len(gc.get_objects()) >= len(alive)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
