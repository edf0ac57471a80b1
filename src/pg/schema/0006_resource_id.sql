-- The resource an operation created or changed (record::ResourceId),
-- stored with its response in the same transaction. NULL for records
-- written before this migration and for handlers that name none; adding a
-- nullable column rewrites nothing. Not indexed: the completion UPDATE that
-- sets it stays a heap-only-tuple update, and "which resource did key X
-- make" is a primary-key lookup.
ALTER TABLE idempotency_requests ADD COLUMN resource_id text;
