-- The schema of task-gateway 0.1.0 (before Alembic), as SQLModel.metadata.create_all made it.
-- Frozen test data: generated once from gateway/store/tables.py of 0.1.0; never regenerate it.

CREATE TABLE callbacks (
	callback_id VARCHAR(256) NOT NULL,
	task_id VARCHAR(128) NOT NULL,
	at_ms BIGINT NOT NULL,
	digest VARCHAR(64) NOT NULL,
	PRIMARY KEY (callback_id)
);

CREATE TABLE deliveries (
	idempotency_key VARCHAR(256) NOT NULL,
	task_id VARCHAR(128) NOT NULL,
	result_ref TEXT NOT NULL,
	result_hash TEXT NOT NULL,
	delivered_at_ms BIGINT NOT NULL,
	PRIMARY KEY (idempotency_key)
);

CREATE TABLE entries (
	task_id VARCHAR(128) NOT NULL,
	version BIGINT NOT NULL,
	type VARCHAR(16) NOT NULL,
	at_ms BIGINT NOT NULL,
	event BLOB NOT NULL,
	PRIMARY KEY (task_id, version)
);

CREATE TABLE outbox (
	id INTEGER NOT NULL,
	task_id VARCHAR(128) NOT NULL,
	state VARCHAR(16) NOT NULL,
	at_ms BIGINT NOT NULL,
	version BIGINT NOT NULL,
	drained_at_ms BIGINT,
	PRIMARY KEY (id)
);

CREATE INDEX ix_outbox_pending ON outbox (id) WHERE drained_at_ms IS NULL;

CREATE UNIQUE INDEX ux_outbox_key ON outbox (task_id, state, version);

CREATE TABLE tasks (
	id VARCHAR(128) NOT NULL,
	state VARCHAR(16) NOT NULL,
	expires_at_ms BIGINT NOT NULL,
	attempts BIGINT NOT NULL,
	max_attempts BIGINT NOT NULL,
	progress INTEGER NOT NULL,
	version BIGINT NOT NULL,
	result_ref TEXT,
	result_hash TEXT,
	error TEXT,
	ttl_ms BIGINT NOT NULL,
	created_at_ms BIGINT NOT NULL,
	PRIMARY KEY (id)
);

CREATE INDEX ix_tasks_live_deadline ON tasks (expires_at_ms) WHERE state IN ('queued', 'running');
