"""The guard in conftest.py (fixture ``streamlit_deprecations``) catches Streamlit's deprecation
warnings: a page calling a deprecated API fails the test, the same page with the current API passes.
Streamlit reports them on its logger, never through the warnings module (checked below too)."""
import warnings

import pytest

pytest.importorskip("streamlit")
pytest.importorskip("plotly")
from streamlit.testing.v1 import AppTest  # noqa: E402


def deprecated_width():
    import plotly.graph_objects as go
    import streamlit as st
    st.plotly_chart(go.Figure(go.Scatter(x=[0, 1], y=[1, 0])), use_container_width=True)  # logged only


def deprecated_column_width():
    import numpy as np
    import streamlit as st
    st.image(np.zeros((4, 4, 3), dtype=np.uint8), use_column_width=True)  # logged (and drawn as st.warning with showErrorDetails=full)


def current_width():
    import plotly.graph_objects as go
    import numpy as np
    import streamlit as st
    st.plotly_chart(go.Figure(go.Scatter(x=[0, 1], y=[1, 0])), width="stretch")
    st.image(np.zeros((4, 4, 3), dtype=np.uint8), width="stretch")


@pytest.mark.parametrize("script,drawn", [(deprecated_width, False), (deprecated_column_width, True)],
                         ids=["plotly_chart-use_container_width", "image-use_column_width"])
def test_guard_fails_a_page_using_a_deprecated_api(script, drawn, streamlit_deprecations):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        at = AppTest.from_function(script, default_timeout=60).run()
    assert not at.exception
    assert streamlit_deprecations.messages, "the deprecated call was not recorded"
    assert any("use_c" in m for m in streamlit_deprecations.messages), streamlit_deprecations.messages
    # the page shows some of them too (AppTest runs with client.showErrorDetails=full); the log has them all
    assert bool([w for w in at.warning if "use_c" in w.value]) == drawn
    with pytest.raises(pytest.fail.Exception, match="Streamlit deprecation warning"):
        streamlit_deprecations.check()
    # not the warnings module: a pytest filterwarnings=error entry would not see these
    assert not [w for w in caught if "use_c" in str(w.message)]
    streamlit_deprecations.messages.clear()  # demonstrated; let this test itself pass


def test_guard_passes_the_current_api(streamlit_deprecations):
    at = AppTest.from_function(current_width, default_timeout=60).run()
    assert not at.exception
    assert streamlit_deprecations.messages == []
    streamlit_deprecations.check()
