//! Cursor pagination for every list: newest first, by id. A cursor is the
//! last id of the page before, so rows committed while a client pages never
//! shift what it has not read yet: no row is shown twice, and none that was
//! committed when the walk began is skipped.
//!
//! A known limit: ids are taken at insert and seen at commit, so a row whose
//! transaction commits after a later id's (billing's batches run for seconds,
//! an API publish for milliseconds) can appear with an id above the cursor,
//! among the ids the walk has already passed, and is not in that walk. A client that syncs by paging down to the newest id it
//! has seen should go back over a margin (a minute of ids, or the last page)
//! or follow the webhooks, which carry every event.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::Serialize;
use utoipa::ToSchema;

use crate::error::ApiError;

pub const DEFAULT_LIMIT: u32 = 20;
pub const MAX_LIMIT: u32 = 100;

/// A page's bounds, checked.
#[derive(Debug, Clone, Copy)]
pub struct Page {
    /// Rows to return; one more is read to know whether more follow.
    pub limit: i64,
    /// Only ids below this one (`None`: from the newest).
    pub before: Option<i64>,
}

impl Page {
    /// # Errors
    /// 400 naming `limit` (1 to 100) or `starting_after` (a cursor from a
    /// previous page).
    pub fn new(limit: Option<u32>, starting_after: Option<&str>) -> Result<Page, ApiError> {
        let limit = limit.unwrap_or(DEFAULT_LIMIT);
        if !(1..=MAX_LIMIT).contains(&limit) {
            return Err(ApiError::out_of_range(
                "limit",
                format!("limit is 1 to {MAX_LIMIT}, not {limit}"),
            ));
        }
        let before = starting_after.map(decode).transpose()?;
        Ok(Page {
            limit: i64::from(limit),
            before,
        })
    }

    /// The SQL `LIMIT`: one row past the page.
    pub fn fetch(&self) -> i64 {
        self.limit + 1
    }

    /// [`Page::list`] of rows as read, each made a `T` by `from_row`.
    ///
    /// # Errors
    /// The first row that does not decode.
    pub fn rows<T, E>(
        &self,
        rows: &[db::PgRow],
        from_row: impl Fn(&db::PgRow) -> Result<T, E>,
        id: impl Fn(&T) -> i64,
    ) -> Result<List<T>, ApiError>
    where
        ApiError: From<E>,
    {
        let items = rows.iter().map(from_row).collect::<Result<Vec<_>, _>>()?;
        Ok(self.list(items, id))
    }

    /// The page from rows read with [`Page::fetch`], newest first.
    pub fn list<T>(&self, mut rows: Vec<T>, id: impl Fn(&T) -> i64) -> List<T> {
        let has_more = rows.len() as i64 > self.limit;
        rows.truncate(self.limit as usize);
        let next_cursor = if has_more {
            rows.last().map(|r| encode(id(r)))
        } else {
            None
        };
        List {
            data: rows,
            has_more,
            next_cursor,
        }
    }
}

/// One page of a list.
#[derive(Debug, Serialize, ToSchema)]
pub struct List<T> {
    pub data: Vec<T>,
    /// True when more rows follow this page.
    pub has_more: bool,
    /// Pass as `starting_after` for the next page; null on the last.
    pub next_cursor: Option<String>,
}

fn encode(id: i64) -> String {
    URL_SAFE_NO_PAD.encode(format!("id:{id}"))
}

fn decode(cursor: &str) -> Result<i64, ApiError> {
    URL_SAFE_NO_PAD
        .decode(cursor)
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .and_then(|s| s.strip_prefix("id:").and_then(|n| n.parse::<i64>().ok()))
        .filter(|n| *n > 0)
        .ok_or_else(|| {
            ApiError::param(
                "starting_after",
                "starting_after is a cursor from a previous page's next_cursor",
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_round_trips_and_junk_is_refused() {
        assert_eq!(decode(&encode(42)).unwrap(), 42);
        for bad in ["", "42", "aWQ6", "aWQ6LTE", "!!"] {
            assert!(decode(bad).is_err(), "{bad}");
        }
        assert!(Page::new(Some(0), None).is_err());
        assert!(Page::new(Some(101), None).is_err());
        assert_eq!(Page::new(None, None).unwrap().limit, 20);
    }

    #[test]
    fn a_page_says_whether_more_follow() {
        let page = Page::new(Some(2), None).unwrap();
        let l = page.list(vec![5, 4, 3], |n| *n);
        assert_eq!((l.data.len(), l.has_more), (2, true));
        assert_eq!(decode(l.next_cursor.as_deref().unwrap()).unwrap(), 4);
        let l = page.list(vec![5, 4], |n| *n);
        assert!(!l.has_more && l.next_cursor.is_none());
    }
}
