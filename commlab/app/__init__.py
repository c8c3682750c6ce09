"""The Streamlit UI: server.py puts the gatekeeper (sign-in on an exposed lab) in front of streamlit_app.py,
whose pages (views/) are thin: they read and start runs through commlab/lab/ only."""
