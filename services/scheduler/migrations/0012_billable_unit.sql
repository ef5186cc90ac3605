-- What the allocation's SKU billed by when it was created (the catalog's billable_unit), kept
-- with the claim snapshot so a later catalog change rebills nothing; the usage ledger counts its
-- records in it. Allocations from before SKUs named a unit bill GPU-seconds, as they did.
ALTER TABLE allocations
  ADD COLUMN billable_unit text NOT NULL DEFAULT 'gpu_second'
    CONSTRAINT allocations_billable_unit CHECK (billable_unit IN ('gpu_second', 'node_second'));
