"""The sandbox user reward code runs in: the worker's side (`client`), the started process (`process`), the
child program (`child`), the confinement steps it takes on itself (`confine`), its private filesystem view
(`view`) and the memory limit of its whole process tree (`memory`).

Nothing is imported here: the child imports this package before it confines itself, standard library only.
"""
