-- As run_inline.sql, the statement called through hc_outcomes (fn_generic.sql), whose
-- plan PL/pgSQL keeps for the session, made under the same settings.
SET enable_bitmapscan = off; SET enable_hashjoin = off; SET enable_mergejoin = off;
SET enable_material = off; SET jit = off;
DO $$ DECLARE ep bigint[]; ev bigint[]; BEGIN
  FOR i IN 0..39 LOOP
    SELECT array_agg(e.id ORDER BY e.id, x.ep), array_agg(x.ep ORDER BY e.id, x.ep) INTO ev, ep
      FROM (SELECT id FROM webhook_events ORDER BY id OFFSET i * 102 LIMIT 102) e
      CROSS JOIN (SELECT id AS ep FROM webhook_endpoints) x;
    EXECUTE $q$SELECT * FROM hc_outcomes($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11)$q$ USING
      array_fill('t'::text, ARRAY[510]), ev, ep, array_fill(1, ARRAY[510]), array_fill('delivered'::text, ARRAY[510]),
      array_fill(0::float8, ARRAY[510]), array_fill(200, ARRAY[510]), array_fill(NULL::text, ARRAY[510]),
      array_fill(3, ARRAY[510]), array_fill(NULL::text, ARRAY[510]), array_fill(extract(epoch FROM now())::float8, ARRAY[510]);
    COMMIT;
  END LOOP; END $$;
