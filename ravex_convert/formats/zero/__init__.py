"""DeepSpeed ZeRO stage 1, 2 and 3: ``reader`` with ``layout`` (the flat
partitions' geometry), and the writer, imported only when ZeRO is written:
``writer`` (files and commit), ``write_plan`` (what goes out, validated) and
``write_layout`` (the partitions' geometry and archives)."""
