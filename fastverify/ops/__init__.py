"""Public op API: one module per op (normalise the arguments -> dispatch -> check the result), the backend choice
shared by all of them (dispatch.py), the argument checks shared by all of them (checks.py), and the fake (meta)
registrations next to each wrapper."""
