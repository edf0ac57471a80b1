//! The fenced transaction of the long-running mode on
//! [`PgStore`](crate::postgres::PgStore)'s connections: `BEGIN`, the
//! waits, and the record held at the lease's token, in one round trip.
//! The mode's other calls are the protocol's (`protocol::lease`), sent
//! through the store's
//! [`Transport`](crate::protocol::transport::Transport).

use super::PgLease;
use crate::{
    metrics::FencedAt,
    postgres::{
        error::map_error,
        prepared::dyn_params,
        transport::{bounded, rollback, timed_out},
        PgTx,
    },
    protocol::{
        claim::begin_with_waits,
        lease::{fenced, token_params, HOLD},
        waits::{GRACE, ROW_WAIT},
    },
    store::StoreError,
};

/// Opens a fenced transaction for `lease`: `BEGIN`, the waits, and the
/// row held at the token, in one round trip.
pub(in crate::postgres) async fn open_fenced(lease: &PgLease) -> Result<PgTx, StoreError> {
    let store = lease.store();
    let mut conn = store.conn().await?;
    let hold = bounded(tokio::time::Instant::now() + ROW_WAIT, async {
        conn.prepare_sql(HOLD).await.map_err(map_error)
    })
    .await;
    let hold = match hold {
        Ok(hold) => hold,
        Err(e) => {
            conn.mark_dirty();
            return Err(e);
        }
    };
    let id = lease.identity();
    let params = token_params(id);
    let params = dyn_params(&params);
    // While the row is held, the owner's own heartbeats wait too. So no
    // lock wait in the transaction may outlast half a lease (the rest of
    // the lease is the margin for the next heartbeat), and should the
    // owner's process stall with the row held, PostgreSQL ends the
    // transaction once it idles for a lease: takeovers are not blocked for
    // longer than the lease they wait for anyway.
    let begin = begin_with_waits(Some(ROW_WAIT.min(id.lease() / 2)), Some(id.lease()));
    conn.mark_dirty();
    let held = tokio::time::timeout(ROW_WAIT + GRACE, async {
        tokio::try_join!(
            biased;
            conn.batch_pipelined(&begin),
            conn.query_opt_prepared(&hold, &params),
        )
    })
    .await;
    let row = match held {
        Err(_) => return Err(timed_out()),
        Ok(Err(e)) => {
            let e = map_error(e);
            let _ = rollback(conn).await;
            return Err(e);
        }
        Ok(Ok((_, row))) => row,
    };
    let Some(row) = row else {
        let _ = rollback(conn).await;
        lease.mark_fenced(Some(FencedAt::Write));
        return Err(fenced());
    };
    let xid: String = row.get(0);
    Ok(PgTx::fenced(conn, id, xid))
}
