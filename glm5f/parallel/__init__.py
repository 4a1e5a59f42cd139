"""parallel: layouts as data -- the mesh rules and placements of each leaf (layout), and the process group
that carries them (distributed). No processes are started here (that is run/launch).

Imports only core/."""
