"""This process serves viewers: from its first script run on, what a spec names is never imported or built
here (commlab.lab.front.ui.serve_viewers), in any thread of the real server and in every script run of a test's AppTest
(which has no server: the threads around it are the test's own)."""
from streamlit import runtime
from streamlit.runtime.scriptrunner_utils.script_run_context import get_script_run_ctx

from commlab.lab.front import ui


def serving() -> bool:
    """True in the Streamlit server's process, and in any thread running a page's script."""
    return runtime.exists() or get_script_run_ctx(suppress_warning=True) is not None


def install() -> None:
    ui.serve_viewers(serving)
