"""Saves left running in the background: waited for by wait_all, settle_all, and at the interpreter's exit.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of background are in test_background.py.
"""

import subprocess
import sys
import textwrap


def test_a_save_that_fails_at_exit_is_named_and_the_exit_status_is_1():
    script = textwrap.dedent(
        """
        from flaxstate import background

        class Lost:
            def wait(self):
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")

            def settle(self):
                pass

        lost = Lost()
        background.track(lost)
        print("trained")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "trained" in done.stdout
    assert "flaxstate: cannot schedule new futures" in done.stderr and "writer.close()" in done.stderr
