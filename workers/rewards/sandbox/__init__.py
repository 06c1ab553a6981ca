"""The sandbox user reward code runs in: the worker's side (`client`), the started process (`process`), the
child program (`child`) and the confinement steps it takes on itself (`confine`).

Nothing is imported here: the child imports this package before it confines itself, standard library only.
"""
