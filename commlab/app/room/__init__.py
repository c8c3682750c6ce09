"""The room's web side, in front of the pages: the gatekeeper (sign-in, sessions and what reaches Streamlit on an
exposed lab), who is looking on every rerun (``access``) and a person's uploads (``uploads``). Every decision
about people and runs is commlab.room's; a lab served on loopback has one viewer, the local user."""
